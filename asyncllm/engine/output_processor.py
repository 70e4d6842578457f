"""Engine core outputs -> RequestOutputs: detokenize, apply stop strings, logprobs, collect.

A request with n > 1 (or best_of) fans out into child requests "{i}_{parent id}" with the same
prompt; a ParentRequest gathers their completions into one RequestOutput. The engine core holds
child 0's siblings back until child 0's prompt is computed (prompt_computed_by).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from asyncllm.engine.detokenizer import IncrementalDetokenizer, backend_tokenizer
from asyncllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from asyncllm.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    PromptLogprobsChunk,
    RequestOutput,
    TokenLogprobs,
)
from asyncllm.sampling_params import RequestOutputKind, SamplingParams


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
    """Joins two deltas; completions pair up by index (a parallel-sampling delta may hold
    only the samples that moved)."""
    merged = {c.index: c for c in old.outputs}
    for after in new.outputs:
        before = merged.get(after.index)
        if before is not None:
            after.text = before.text + after.text
            after.token_ids = before.token_ids + after.token_ids
            if before.logprobs is not None and after.logprobs is not None:
                after.logprobs = before.logprobs + after.logprobs
        merged[after.index] = after
    new.outputs = sorted(merged.values(), key=lambda c: c.index)
    if new.prompt_logprobs is None:
        new.prompt_logprobs = old.prompt_logprobs
    return new


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer | None
    collector: RequestOutputCollector | None
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0
    first_scheduled_time: float | None = None  # reported by the engine core
    first_token_time: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # when the request asked for logprobs
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None  # when it asked for prompt_logprobs
    num_sent_prompt_logprobs: int = 0
    parent: ParentRequest | None = None
    index: int = 0  # this sample's index in its parent


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # requests that hit a stop string: the engine core must stop them too
    stopped_request_ids: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self._decoder = backend_tokenizer(tokenizer) if tokenizer is not None else None
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        collector: RequestOutputCollector | None = None,
    ) -> list[EngineCoreRequest]:
        """Registers a request; returns the engine requests to add to the core."""
        params = request.sampling_params
        if params.num_samples == 1:
            self.states[request.request_id] = self._new_state(request, prompt, collector)
            return [request]
        children = fan_out(request)
        parent = ParentRequest(request, prompt, collector, [c.request_id for c in children])
        self.parents[request.request_id] = parent
        for i, child in enumerate(children):
            state = self._new_state(child, prompt, None)
            state.parent, state.index = parent, i
            self.states[child.request_id] = state
        return children

    def abort(self, request_ids: list[str]) -> list[str]:
        """Forgets requests; returns the engine request ids to abort (a parent's samples)."""
        engine_ids = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            ids = parent.child_ids if parent is not None else [request_id]
            for engine_id in ids:
                self.states.pop(engine_id, None)
            engine_ids += ids
        return engine_ids

    def note_first_scheduled(self, times: dict[str, float]) -> None:
        for request_id, when in times.items():
            state = self.states.get(request_id)
            if state is not None:
                state.first_scheduled_time = when

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        processed = ProcessedOutputs([], [])
        for out in self._token_by_token_where_stop_strings(outputs):
            state = self.states.get(out.request_id)
            if state is None:  # aborted while its step ran
                continue
            finish_reason, stop_reason = self._advance(state, out)
            if finish_reason is not None and out.finish_reason is None:
                processed.stopped_request_ids.append(out.request_id)
            request_output = self._make_output(state, out, finish_reason, stop_reason)
            if finish_reason is not None:
                del self.states[out.request_id]
            if state.parent is not None:
                request_output = self._add_to_parent(state, request_output, out)
            if request_output is None:
                continue
            collector = state.parent.collector if state.parent else state.collector
            if collector is not None:
                collector.put(request_output)
            else:
                processed.request_outputs.append(request_output)
        return processed

    def _token_by_token_where_stop_strings(
        self, outputs: list[EngineCoreOutput]
    ) -> Iterator[EngineCoreOutput]:
        """An output may carry several tokens (steps joined while the event loop was busy);
        a request with stop strings takes them one at a time, so that a stop string ends it at
        the token that completes it (the tokens after it find the request gone)."""
        for out in outputs:
            state = self.states.get(out.request_id)
            detokenizer = state.detokenizer if state is not None else None
            if len(out.new_token_ids) > 1 and detokenizer and detokenizer.has_stop_strings:
                yield from split_by_token(out)
            else:
                yield out

    def _new_state(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        collector: RequestOutputCollector | None,
    ) -> RequestState:
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
        asked = params.logprobs is not None
        return RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            kind=params.output_kind,
            detokenizer=detokenizer,
            collector=collector,
            logprobs=[] if asked else None,
            cumulative_logprob=0.0 if asked else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            arrival_time=request.arrival_time,
        )

    def _advance(
        self, state: RequestState, out: EngineCoreOutput
    ) -> tuple[str | None, int | str | None]:
        """Take in the new tokens; a completed stop string finishes the request here."""
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = time.monotonic()
        state.token_ids += out.new_token_ids
        self._add_logprobs(state, out)
        if state.detokenizer is not None:
            stop_str = state.detokenizer.update(out.new_token_ids)
            if stop_str is not None:
                return "stop", stop_str
        return out.finish_reason, out.stop_reason

    def _add_logprobs(self, state: RequestState, out: EngineCoreOutput) -> None:
        if state.logprobs is not None and out.new_logprobs:
            for entry in out.new_logprobs:
                state.logprobs.append(self._logprob_dict(entry))
                state.cumulative_logprob += entry.logprob
        chunk = out.new_prompt_logprobs
        if state.prompt_logprobs is not None and chunk is not None:
            self._add_prompt_logprobs(state.prompt_logprobs, chunk)

    def _add_prompt_logprobs(
        self, prompt_logprobs: PromptLogprobs, chunk: PromptLogprobsChunk
    ) -> None:
        """Appends the positions not seen yet (a preempted request scores its prompt again)."""
        skip = len(prompt_logprobs) - chunk.start
        for entry in chunk.tokens[max(skip, 0) :]:
            prompt_logprobs.append(self._logprob_dict(entry))

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        ids = [entry.token_id, *entry.top_ids]
        texts = self._decode_each(ids)
        logprobs = {entry.token_id: Logprob(entry.logprob, entry.rank, texts[0])}
        for rank, (token_id, value) in enumerate(zip(entry.top_ids, entry.top_logprobs), 1):
            logprobs.setdefault(token_id, Logprob(value, rank, texts[rank]))
        return logprobs

    def _decode_each(self, token_ids: list[int]) -> list[str | None]:
        if self._decoder is None:
            return [None] * len(token_ids)
        return self._decoder.decode_batch([[t] for t in token_ids], skip_special_tokens=False)

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
        if not out.new_token_ids and not finished:
            return None  # prompt logprobs of a prefill chunk: they go out with the first token
        delta = state.kind == RequestOutputKind.DELTA
        text = ""
        if state.detokenizer is not None:
            text = state.detokenizer.get_next_output_text(finished, delta)
        start = state.num_sent_tokens if delta else 0
        state.num_sent_tokens = len(state.token_ids)
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=state.token_ids[start:],
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None if state.logprobs is None else state.logprobs[start:],
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
            prompt_logprobs=self._new_prompt_logprobs(state, delta),
        )

    @staticmethod
    def _new_prompt_logprobs(state: RequestState, delta: bool) -> PromptLogprobs | None:
        if state.prompt_logprobs is None or (delta and state.num_sent_prompt_logprobs):
            return None
        state.num_sent_prompt_logprobs = len(state.prompt_logprobs)
        return state.prompt_logprobs

    def _add_to_parent(
        self, state: RequestState, output: RequestOutput | None, out: EngineCoreOutput
    ) -> RequestOutput | None:
        parent = state.parent
        if output is not None:
            parent.record(state.index, output)
        if out.error is not None:
            parent.error = out.error
        if not parent.finished:
            if output is None or parent.final_only:
                return None
            return parent.make_output(output)
        for request_id in parent.child_ids:
            self.states.pop(request_id, None)
        self.parents.pop(parent.request_id, None)
        return parent.make_output(output)

    @staticmethod
    def _metrics(state: RequestState) -> dict[str, float]:
        metrics = {"arrival_time": state.arrival_time}
        if state.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = state.first_scheduled_time
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        return metrics


class ParentRequest:
    """Gathers the completions of a request's parallel samples into one RequestOutput."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        collector: RequestOutputCollector | None,
        child_ids: list[str],
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.params = params
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.collector = collector
        self.child_ids = child_ids
        self.completions: dict[int, CompletionOutput] = {}
        self.first: RequestOutput | None = None  # child 0's latest: prompt logprobs, cache hits
        self.num_finished = 0
        self.error: str | None = None
        self.arrival_time = request.arrival_time

    @property
    def final_only(self) -> bool:
        """best_of must see every sample before it can choose, so it never streams."""
        return self.params.output_kind == RequestOutputKind.FINAL_ONLY or self._choosing

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.child_ids)

    @property
    def _choosing(self) -> bool:
        return self.params.num_samples > self.params.n

    def record(self, index: int, output: RequestOutput) -> None:
        self.completions[index] = output.outputs[0]
        if index == 0:
            self.first = output
        self.num_finished += output.finished

    def make_output(self, latest: RequestOutput | None) -> RequestOutput:
        kind = self.params.output_kind
        if self._choosing:
            completions = self._best_completions()
        elif kind == RequestOutputKind.DELTA:  # a delta carries the sample that moved
            completions = latest.outputs if latest is not None else []
        else:
            completions = self._all_completions()
        streams_deltas = kind == RequestOutputKind.DELTA and not self._choosing
        source = latest if streams_deltas else self.first
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=self.first.num_cached_tokens if self.first else 0,
            error=self.error,
            metrics={"arrival_time": self.arrival_time},
            prompt_logprobs=source.prompt_logprobs if source else None,
        )

    def _all_completions(self) -> list[CompletionOutput]:
        empty = [CompletionOutput(i, "", []) for i in range(len(self.child_ids))]
        return [self.completions.get(i, c) for i, c in enumerate(empty)]

    def _best_completions(self) -> list[CompletionOutput]:
        """The n samples with the highest cumulative logprob, re-indexed 0 .. n - 1."""
        ranked = sorted(
            self._all_completions(), key=lambda c: c.cumulative_logprob or 0.0, reverse=True
        )
        best = ranked[: self.params.n]
        for index, completion in enumerate(best):
            completion.index = index
            if self.params.logprobs is None:  # computed only to rank the samples
                completion.logprobs = None
                completion.cumulative_logprob = None
        return best


def split_by_token(out: EngineCoreOutput) -> Iterator[EngineCoreOutput]:
    """One output per new token; the finish fields go with the last."""
    last = len(out.new_token_ids) - 1
    for i, token_id in enumerate(out.new_token_ids):
        yield dataclasses.replace(
            out,
            new_token_ids=[token_id],
            new_logprobs=None if out.new_logprobs is None else out.new_logprobs[i : i + 1],
            new_prompt_logprobs=out.new_prompt_logprobs if i == 0 else None,
            finish_reason=out.finish_reason if i == last else None,
            stop_reason=out.stop_reason if i == last else None,
            error=out.error if i == last else None,
        )


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The engine requests of a request's parallel samples: same prompt, seed + i when seeded,
    prompt logprobs only on sample 0, whose prompt the others wait for. best_of samples always
    compute their logprobs to rank."""
    params = request.sampling_params
    first_id = child_request_id(0, request.request_id)
    return [
        dataclasses.replace(
            request,
            request_id=child_request_id(i, request.request_id),
            sampling_params=_child_params(params, i),
            prompt_computed_by=first_id if i else None,
        )
        for i in range(params.num_samples)
    ]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    choosing = params.num_samples > params.n
    logprobs = params.logprobs
    if choosing and logprobs is None:
        logprobs = 0
    return dataclasses.replace(
        params,
        n=1,
        best_of=None,
        seed=None if params.seed is None else params.seed + index,
        logprobs=logprobs,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
        output_kind=RequestOutputKind.FINAL_ONLY if choosing else params.output_kind,
    )
