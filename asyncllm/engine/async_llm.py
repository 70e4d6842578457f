"""AsyncLLM: the asyncio front end. One background engine task takes in the engine core's steps
(from its thread in this process, or from its own process) while generate() iterators hand
each request's outputs to its consumer."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from typing import Any

from asyncllm.config import EngineArgs
from asyncllm.engine.front_end import FrontEnd
from asyncllm.engine.input_processor import PromptType
from asyncllm.engine.messages import EngineStats
from asyncllm.engine.output_processor import RequestOutputCollector, child_request_id
from asyncllm.engine.prompt_tokenizer import PromptTokenizer
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed and cannot continue; every open request ends with this."""


class AsyncLLM(FrontEnd):
    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args, core_process_allowed=True)
        self.collectors: dict[str, RequestOutputCollector] = {}
        tokenizer = self.tokenizer
        self.prompt_tokenizer = PromptTokenizer(tokenizer) if tokenizer is not None else None
        self._task: asyncio.Task | None = None
        self.dead_error: BaseException | None = None
        # tokens scheduled in a step -> how many steps scheduled that many, for /metrics: at
        # most max_num_batched_tokens keys, however long the engine runs
        self.steps_by_num_tokens: collections.Counter[int] = collections.Counter()

    @classmethod
    def from_engine_args(cls, args: EngineArgs | None = None, **kwargs: Any) -> AsyncLLM:
        return cls(args or EngineArgs(**kwargs))

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; leaving the loop early aborts the request."""
        self._check_alive()
        if request_id in self.collectors:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        collector = RequestOutputCollector(sampling_params.output_kind)
        self.collectors[request_id] = collector  # holds the id while the prompt is tokenized
        try:
            prompt = await self._with_token_ids(prompt, add_special_tokens)
            self._check_alive()
            if self.collectors.get(request_id) is not collector:
                return  # aborted while its prompt was tokenized
            request, text = self.make_request(
                request_id, prompt, sampling_params, priority, add_special_tokens
            )
            self.add_request(request, text, collector)
        except BaseException:
            if self.collectors.get(request_id) is collector:
                del self.collectors[request_id]
            raise
        self._ensure_engine_task()
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            self.collectors.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _with_token_ids(self, prompt: PromptType, add_special_tokens: bool) -> PromptType:
        """A text prompt with its token ids, from the tokenizer's thread."""
        text = self.input_processor.prompt_text(prompt)
        if text is None:
            return prompt
        token_ids = await self.prompt_tokenizer.encode(text, add_special_tokens)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def abort(self, request_id: str) -> None:
        """Stop a request (all its parallel samples); its blocks are freed before the next step."""
        self.abort_request(request_id)
        self.collectors.pop(request_id, None)

    def stats(self) -> EngineStats:
        """As of the last step taken in."""
        return self.latest_stats

    def is_queued(self, request_id: str) -> bool:
        """Whether the engine holds this request (or its first sample) and has not scheduled it
        yet."""
        states = self.output_processor.states
        state = states.get(request_id) or states.get(child_request_id(0, request_id))
        return state is not None and state.first_scheduled_time is None

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.prompt_tokenizer is not None:
            self.prompt_tokenizer.shutdown()
        self.core_client.shutdown()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")

    def _ensure_engine_task(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run_engine())

    async def _run_engine(self) -> None:
        try:
            while True:
                # with async scheduling, detokenizes step N while step N+1 computes
                step = await self.core_client.get_output_async()
                self.process_step(step)
                self.steps_by_num_tokens.update(step.num_scheduled_tokens)
                await asyncio.sleep(0)  # let consumers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            logger.exception("engine loop died")
            self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        self.dead_error = error
        dead = EngineDeadError(f"the engine has stopped: {error!r}")
        for collector in self.collectors.values():
            collector.put(dead)
