"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no prefill and decode phases: every scheduled request catches its num_computed_tokens
up to its num_tokens, running requests first (in order), then waiting ones (in queue order).
A step that samples leaves a placeholder for the token until it comes back, so the next step can
be scheduled while this one runs (async scheduling): that step's input token is the placeholder,
which the model runner takes from the device. Speculating with drafts made on the device, the
next step's drafts are placeholders too, and it starts as if every draft in flight were
accepted; the runner moves it back by those rejected, and _roll_back does the same here once
the step in flight has come back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from asyncllm.config import SchedulerConfig
from asyncllm.core.kv_cache_manager import KVCacheManager, cdiv
from asyncllm.core.request_queue import create_request_queue
from asyncllm.core.scheduler_output import (
    DRAFT_ON_DEVICE,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from asyncllm.request import Request, RequestStatus


@dataclass
class _Step:
    """What one schedule() call has decided so far."""

    budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    first_scheduled: dict[str, float] = field(default_factory=dict)


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}  # unfinished requests only
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_req_ids: set[str] = set()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def add_request(self, request: Request) -> None:
        """The front end has checked that the request fits (check_fits)."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} already exists.")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        # a step that had to preempt has no room to admit anyone
        if not step.preempted:
            self._schedule_waiting(step)
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            list(step.scheduled.values()), step.preempted, finished, step.first_scheduled
        )

    def describe(self, output: SchedulerOutput) -> str:
        """One step's decisions in a line (ASYNCLLM_LOG_SCHEDULER): each scheduled request with
        its new tokens, the preempted, the token budget used, the KV blocks in use."""
        kv = self.kv_cache_manager
        scheduled = " ".join(f"{s.request.request_id}+{s.num_new_tokens}" for s in output.scheduled)
        return (
            f"scheduled {len(output.scheduled)} [{scheduled}]"
            f" preempted {len(output.preempted_req_ids)} {sorted(output.preempted_req_ids)}"
            f" tokens {output.total_num_scheduled_tokens}/{self.config.max_num_batched_tokens}"
            f" kv_blocks {kv.num_blocks - kv.num_free_blocks}/{kv.num_blocks}"
            f" running {self.num_running} waiting {self.num_waiting}"
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Appends the sampled tokens; returns the requests that finished. A request that stops
        part way through a verify step's tokens takes those up to the stop: the row's list in
        model_runner_output.verified is cut to them."""
        finished: list[Request] = []
        for row, scheduled in enumerate(scheduler_output.scheduled):
            request = scheduled.request
            if request.status is not RequestStatus.RUNNING:
                continue  # finished or preempted while the step ran
            tokens = model_runner_output.tokens_of(row)
            self._roll_back(scheduled, tokens)
            if not tokens:  # a prompt chunk: never scheduled ahead, so it starts where it says
                num_computed = scheduled.num_computed_tokens + scheduled.num_new_tokens
                self.kv_cache_manager.cache_blocks(request, num_computed)
                continue
            request.num_output_placeholders -= 1
            status = self._append_tokens(request, tokens)
            # every token but the one just sampled has its KV computed (a step run ahead may
            # compute more, from the device); rejected drafts never reach all_token_ids, so no
            # block of them is ever hashed
            self.kv_cache_manager.cache_blocks(request, request.num_tokens - 1)
            if status is not None:
                request.status = status
                self._free(request)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def _roll_back(self, scheduled: ScheduledRequest, tokens: list[int]) -> None:
        """Takes the rejected drafts' positions off the request's computed tokens (their KV
        is overwritten by the tokens that follow). A step scheduled ahead of this one counted
        them as accepted: the runner has moved it back by as many, on the device."""
        request = scheduled.request
        request.num_spec_in_flight = 0
        num_drafts = len(scheduled.spec_token_ids)
        num_rejected = num_drafts - max(len(tokens) - 1, 0) if tokens else num_drafts
        request.num_computed_tokens -= num_rejected

    def _append_tokens(self, request: Request, tokens: list[int]) -> RequestStatus | None:
        """Appends tokens up to the first that stops the request (cutting the list there)."""
        for taken, token_id in enumerate(tokens, 1):
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                del tokens[taken:]
                return status
        return None

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finishes requests from outside (abort, stop string); unknown ids are ignored."""
        if not status.finished:
            raise ValueError(f"{status.name} is not a finished status.")
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        waiting: set[Request] = set()
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is not RequestStatus.RUNNING:
                waiting.add(request)
            request.status = status
            self._free(request)
        if waiting:
            self.waiting.remove_requests(waiting)
        self.running = [r for r in self.running if not r.is_finished]

    def _schedule_running(self, step: _Step) -> None:
        for request in list(self.running):
            if step.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            ahead = request.num_output_placeholders > 0
            if ahead and not self._may_run_ahead(request):
                continue
            if ahead and self.config.num_lookahead_tokens:
                num_new, drafts = 1, self._drafts_ahead(request, step.budget)
            else:
                num_new = self._num_new_tokens(request, request.num_computed_tokens, step.budget)
                if num_new == 0:
                    continue
                drafts = self._drafts(request, num_new, step.budget)
            # drafts never preempt anyone: without room for them the request goes without
            block_ids = None
            if drafts:
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new + len(drafts))
            if block_ids is None:
                drafts = []
                block_ids = self._allocate_or_preempt(request, num_new, step)
            if block_ids is not None:
                self._record(request, num_new, block_ids, step, drafts)

    def _schedule_waiting(self, step: _Step) -> None:
        while self.waiting and step.budget > 0:
            request = self.waiting.peek()
            if request.request_id in step.preempted:
                break  # it does not come back in the step that preempted it
            computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = self._num_new_tokens(request, num_hit, step.budget)
            if num_new == 0:
                break
            block_ids = None
            if len(self.running) < self.config.max_num_seqs:
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
            if block_ids is not None:
                self._admit(request, num_hit, num_new, block_ids, step)
            elif not self._preempt_lower_priority(request, step):
                break

    def _may_run_ahead(self, request: Request) -> bool:
        """Whether to schedule a request whose last token is still being sampled: not when that
        token is its last anyway. Speculating, only where the drafts are made on the device
        and the request's sampling reads nothing the host must count first (runs_ahead)."""
        if self.config.num_lookahead_tokens and not (
            self.config.drafts_on_device and runs_ahead(request)
        ):
            return False
        # the token the step samples sits after those computed (drafts counted as accepted)
        return (
            request.num_output_tokens + request.num_output_placeholders < request.max_tokens
            and request.num_computed_tokens + 1 < self.config.max_model_len
        )

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens + request.num_output_placeholders - num_computed
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        if num_new > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(num_new, budget)

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's proposed drafts that fit after its last token: in the step's budget,
        its max_tokens and max_model_len, each counting the token sampled after them."""
        if not request.spec_token_ids or request.num_output_placeholders:
            return []
        if request.num_computed_tokens + num_new != request.num_tokens:
            return []
        room = min(
            budget - num_new,
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )
        return request.spec_token_ids[: max(room, 0)]

    def _drafts_ahead(self, request: Request, budget: int) -> list[int]:
        """Placeholders for the drafts of a step scheduled while the request's last step runs:
        its input token, its drafts and where it starts are all on the device. The request's
        num_computed_tokens counts the step in flight's drafts as accepted, so the room left
        under max_model_len here holds however many are."""
        room = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - request.num_output_placeholders - 1,
            self.config.max_model_len - request.num_computed_tokens - 1,
            self.config.num_lookahead_tokens,
        )
        return [DRAFT_ON_DEVICE] * max(room, 0)

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _Step) -> list[int] | None:
        while (block_ids := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return None
        return block_ids

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt_lower_priority(self, request: Request, step: _Step) -> bool:
        """Under the priority policy, makes room for a waiting request by preempting a worse one."""
        if self.config.policy != "priority" or not self.running:
            return False
        victim = self._pick_victim()
        if _priority_key(victim) <= _priority_key(request):
            return False
        self._preempt(victim, step)
        return True

    def _preempt(self, request: Request, step: _Step) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight is dropped and sampled again
        request.spec_token_ids = []
        request.num_spec_in_flight = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        undone = step.scheduled.pop(request.request_id, None)
        if undone is not None:
            step.budget += undone.num_new_tokens
        step.preempted.add(request.request_id)
        self.waiting.prepend(request)

    def _admit(
        self, request: Request, num_hit: int, num_new: int, block_ids: list[int], step: _Step
    ) -> None:
        self.waiting.pop()
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
            step.first_scheduled[request.request_id] = time.monotonic()
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._record(request, num_new, block_ids, step)

    def _record(
        self,
        request: Request,
        num_new: int,
        block_ids: list[int],
        step: _Step,
        drafts: list[int] | None = None,
    ) -> None:
        drafts = drafts or []
        num_new += len(drafts)
        scheduled = ScheduledRequest(
            request, num_new, request.num_computed_tokens, block_ids, drafts
        )
        step.scheduled[request.request_id] = scheduled
        request.num_computed_tokens += num_new
        request.spec_token_ids = []
        request.num_spec_in_flight = len(drafts)
        if scheduled.completes_prompt:
            request.num_output_placeholders += 1
        step.budget -= num_new

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_req_ids.add(request.request_id)


def runs_ahead(request: Request) -> bool:
    """Whether a speculating request may be scheduled while its last step runs. Not with a
    grammar (its drafts are checked on the host), a seed or min_tokens (its sampling counts
    the tokens taken so far), penalties or bad words (it has no drafts: drafting stays in
    step with the host)."""
    params = request.sampling_params
    return (
        request.grammar is None
        and params.seed is None
        and params.min_tokens == 0
        and not params.uses_penalties
        and not request.bad_words_token_ids
    )


def check_fits(
    num_prompt_tokens: int,
    max_tokens: int,
    config: SchedulerConfig,
    num_blocks: int,
    block_size: int,
) -> None:
    """Rejects a request that could never run, which would otherwise preempt itself forever
    (the input processor has checked the prompt against max_model_len)."""
    final_len = min(num_prompt_tokens + max_tokens, config.max_model_len)
    # the last sampled token is never computed, so it needs no KV slot
    max_computed = max(num_prompt_tokens, final_len - 1)
    if not config.enable_chunked_prefill and max_computed > config.max_num_batched_tokens:
        raise ValueError(
            f"the request may need {max_computed} tokens in one step (without chunked "
            f"prefill), over max_num_batched_tokens ({config.max_num_batched_tokens})."
        )
    needed = cdiv(max_computed, block_size)
    if needed > num_blocks:
        raise ValueError(
            f"the request needs up to {needed} KV cache blocks, the cache has {num_blocks}."
        )
