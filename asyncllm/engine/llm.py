"""LLM: the offline API, running batches to completion on the engine core in this process."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from asyncllm.config import EngineArgs
from asyncllm.engine.front_end import FrontEnd
from asyncllm.engine.input_processor import PromptType
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM(FrontEnd):
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown arguments: {', '.join(sorted(unknown))}")
        super().__init__(EngineArgs(model=model, **kwargs), core_process_allowed=False)
        self._ids = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        return self._run(prompts, sampling_params, use_tqdm, priority, add_special_tokens=True)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        apply = self.input_processor.apply_chat_template
        prompts = [apply(list(c), **(chat_template_kwargs or {})) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, None, add_special_tokens=False)

    def _run(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = _broadcast(sampling_params or self.get_default_sampling_params(), len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        # validate everything before anything reaches the engine
        requests = [
            self.make_request(
                str(next(self._ids)), prompt, _final_only(p), prio, add_special_tokens
            )
            for prompt, p, prio in zip(prompts, params, priorities)
        ]
        for request, text in requests:
            self.add_request(request, text)
        return self._run_to_completion([r.request_id for r, _ in requests], use_tqdm)

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        core_has_work = True
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            # on to the core's end, so that it frees what stopped requests held
            while core_has_work or len(finished) < len(request_ids):
                step = self.core_client.get_output()
                core_has_work = step.has_work
                # with async scheduling, detokenizes step N while step N+1 computes
                for output in self.process_step(step):
                    finished[output.request_id] = output
                    bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _broadcast(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts.")
    return list(params)


def _final_only(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
