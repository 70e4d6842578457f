"""A request as the engine core sees it: tokens, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from asyncllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # every status after this point is finished
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16  # resolved from sampling_params and the context length
    priority: int = 0
    # token ids of each of sampling_params.bad_words, filled by the input processor
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    # the compiled grammar of sampling_params.structured_outputs (an xgrammar CompiledGrammar),
    # set by the engine core before the request is scheduled
    grammar: object | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # tokens a launched step is sampling for this request, not yet on the host
    num_output_placeholders: int = 0
    # tokens found in the prefix cache when first scheduled; -1 until then
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # chained hashes of this request's full blocks, filled by the KV cache manager
    block_hashes: list[int] = field(default_factory=list)
    # speculative decoding: draft tokens proposed to follow all_token_ids, for the next step
    # to verify, and the drafts of the step in flight (it is not scheduled ahead of them)
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_in_flight: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
