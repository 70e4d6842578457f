"""What crosses between the front end (LLM, AsyncLLM) and the engine core, in either process
layout: plain, picklable values only (token ids, parameters, results), never a live object.

Front end -> core: EngineCoreRequest, FinishRequests, Profile, Shutdown.
Core -> front end: Ready (or Failed) once the model is loaded, then one CoreStep per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncllm.outputs import PromptLogprobsChunk, TokenLogprobs
from asyncllm.request import RequestStatus
from asyncllm.sampling_params import SamplingParams
from asyncllm.spec_decode.metrics import SpecDecodingStats


@dataclass(frozen=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved from sampling_params and the context length
    arrival_time: float
    priority: int = 0
    # token ids of each of sampling_params.bad_words
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # a parallel sample waits until this sibling has computed their shared prompt, so that it
    # finds the prompt's blocks in the prefix cache instead of computing them side by side
    prompt_computed_by: str | None = None


@dataclass(frozen=True)
class FinishRequests:
    """Abort (the client left) or stop (the front end found a stop string) these requests."""

    request_ids: list[str]
    status: RequestStatus


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Profile:
    """Start (or stop, writing the trace) the core's torch profiler."""

    start: bool


@dataclass(frozen=True)
class KVCapacity:
    """The KV cache's size, for the front end to refuse requests that could never fit."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class Ready:
    capacity: KVCapacity


@dataclass(frozen=True)
class Failed:
    error: str


@dataclass(frozen=True)
class EngineCoreOutput:
    """One request's share of a step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    new_prompt_logprobs: PromptLogprobsChunk | None = None


@dataclass(frozen=True)
class EngineStats:
    """What /metrics reports about the scheduler and the KV cache."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding on


@dataclass(frozen=True)
class CoreStep:
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    # the core still has requests or steps in flight after this step
    has_work: bool = False
    # request id -> time.monotonic() of its first scheduling, for the requests first scheduled
    # since the last CoreStep (queue-time metrics, --max-queue-wait)
    first_scheduled: dict[str, float] = field(default_factory=dict)
    # the tokens scheduled in each engine step finished since the last CoreStep (one entry per
    # step, several in steps joined together), for the iteration_tokens metric
    num_scheduled_tokens: list[int] = field(default_factory=list)
