"""Engine core outputs -> RequestOutputs: detokenize, apply stop strings, hand to collectors."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from asyncllm.engine.core import EngineCoreOutput
from asyncllm.engine.detokenizer import IncrementalDetokenizer
from asyncllm.outputs import CompletionOutput, RequestOutput
from asyncllm.request import Request
from asyncllm.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """Holds the newest output for one consumer; merges deltas when the consumer is slow,
    so a slow reader never makes the engine queue outputs without bound."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        both_outputs = isinstance(self.output, RequestOutput) and isinstance(output, RequestOutput)
        if both_outputs and self.kind == RequestOutputKind.DELTA:
            output = _merge_delta(self.output, output)
        self.output = output
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


def _merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    for before, after in zip(old.outputs, new.outputs):
        after.text = before.text + after.text
        after.token_ids = before.token_ids + after.token_ids
    return new


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer | None
    collector: RequestOutputCollector | None
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # requests that hit a stop string: the engine core must stop them too
    stopped_request_ids: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, request: Request, prompt: str | None, collector: RequestOutputCollector | None = None
    ) -> None:
        params = request.sampling_params
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        self.states[request.request_id] = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            kind=params.output_kind,
            detokenizer=detokenizer,
            collector=collector,
        )

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        request_outputs, stopped = [], []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:  # aborted while its step ran
                continue
            finish_reason, stop_reason = self._advance(state, out)
            if finish_reason is not None and out.finish_reason is None:
                stopped.append(out.request_id)
            request_output = self._make_output(state, out, finish_reason, stop_reason)
            if finish_reason is not None:
                del self.states[out.request_id]
            if request_output is None:
                continue
            if state.collector is not None:
                state.collector.put(request_output)
            else:
                request_outputs.append(request_output)
        return ProcessedOutputs(request_outputs, stopped)

    def _advance(
        self, state: RequestState, out: EngineCoreOutput
    ) -> tuple[str | None, int | str | None]:
        """Take in the new tokens; a completed stop string finishes the request here."""
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = time.monotonic()
        state.token_ids += out.new_token_ids
        if state.detokenizer is not None:
            stop_str = state.detokenizer.update(out.new_token_ids)
            if stop_str is not None:
                return "stop", stop_str
        return out.finish_reason, out.stop_reason

    def _make_output(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        if state.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = state.kind == RequestOutputKind.DELTA
        text = ""
        if state.detokenizer is not None:
            text = state.detokenizer.get_next_output_text(finished, delta)
        token_ids = state.token_ids[state.num_sent_tokens :] if delta else list(state.token_ids)
        state.num_sent_tokens = len(state.token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=out.num_cached_tokens,
            error=out.error,
            metrics=self._metrics(state),
        )

    @staticmethod
    def _metrics(state: RequestState) -> dict[str, float]:
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        return metrics
