"""The grammar state of each constrained request on the worker. A step's token bitmask is filled
on a thread of its own while the runner enqueues the step's forward pass and the device runs it:
the fill first takes in the tokens the step before sampled (waiting for them, if that step still
runs), then fills every row's mask with xgrammar's batched fill, on several threads. The runner
waits for the fill only when the sampler needs the mask.

Invariant: a fill starts and ends within one step's launch, so the matchers are never touched by
the fill thread and the runner's thread at once."""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from asyncllm.sample.grammar_mask import TokenBitmask
from asyncllm.sampling_params import ReasoningMarkers
from asyncllm.structured_output.reasoning import Phase, ReasoningTracker

logger = logging.getLogger(__name__)
# xgrammar's "auto" takes half of std::thread::hardware_concurrency(), the host's cores rather
# than those this process may use; past 8 threads a 256-row fill gains little and takes cores
# from the front end and the collector
_MAX_FILL_THREADS = 8


def fill_threads() -> int:
    """Threads for the batched bitmask fill: half the cores this process may run on, 1 to 8."""
    return max(1, min(_MAX_FILL_THREADS, len(os.sched_getaffinity(0)) // 2))


@dataclass
class ConstrainedRow:
    sampling_row: int  # of the step's sampled ids
    logits_row: int  # of the logits (a step verifying drafts scores several rows a request)
    request_id: str
    grammar: xgr.CompiledGrammar
    # the outputs this row's sample follows; read only to start a matcher, which happens when
    # they are all on the host (a prompt completed, after admission or preemption)
    output_token_ids: Sequence[int]
    num_output_tokens: int
    prompt_token_ids: Sequence[int]
    reasoning: ReasoningMarkers | None


def constrained_rows(scheduled: list, logits_rows: list[int]) -> list[ConstrainedRow]:
    """The rows of the sampling requests (ScheduledRequests) whose request has a grammar."""
    rows = []
    for sampling_row, (s, logits_row) in enumerate(zip(scheduled, logits_rows)):
        request = s.request
        if request.grammar is not None:
            num_outputs = s.num_computed_tokens + s.num_new_tokens - request.num_prompt_tokens
            rows.append(
                ConstrainedRow(
                    sampling_row,
                    logits_row,
                    request.request_id,
                    request.grammar,
                    request.output_token_ids,
                    num_outputs,
                    request.prompt_token_ids,
                    request.sampling_params.structured_outputs.reasoning,
                )
            )
    return rows


@dataclass
class _Sampled:
    """Ids a launched step sampled for constrained requests, readable once `done` happened."""

    request_ids: list[str]
    positions: list[int]  # of each request's id in token_ids
    token_ids: torch.Tensor  # host, int64
    done: torch.cuda.Event | None


class _Tracked:
    def __init__(self, row: ConstrainedRow) -> None:
        self.matcher = xgr.GrammarMatcher(row.grammar)
        self.reasoning = ReasoningTracker(row.reasoning, row.prompt_token_ids)
        self.num_accepted = 0
        self.broken = False  # took a token its grammar forbids: no longer constrained
        for token_id in row.output_token_ids[: row.num_output_tokens]:
            self.accept(token_id)

    def accept(self, token_id: int) -> None:
        self.num_accepted += 1
        if not self.reasoning.take(token_id):
            return
        if self.broken or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            logger.warning(
                "a constrained request took token %d, which its grammar forbids", token_id
            )
            self.broken = True

    @property
    def constrains(self) -> bool:
        thinking = self.reasoning.phase is Phase.THINKING
        return not (thinking or self.broken or self.matcher.is_terminated())


class GrammarMatchers:
    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._host = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self._rows = torch.zeros(max_rows, dtype=torch.int64)
        if pin:
            self._host, self._rows = self._host.pin_memory(), self._rows.pin_memory()
        self._words = torch.zeros(self._host.shape, dtype=torch.int32, device=device)
        self._row_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.num_threads = fill_threads()
        self._batch = xgr.BatchGrammarMatcher(self.num_threads)
        self._filler = concurrent.futures.ThreadPoolExecutor(1, "grammar-fill")
        self._fill: concurrent.futures.Future[None] | None = None
        # the last bitmask's copy to the device: the host rows are not refilled before it ran
        self._copied: torch.cuda.Event | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._sampled: _Sampled | None = None

    def forget(self, request_ids: set[str]) -> None:
        self._wait_fill()
        for request_id in request_ids:
            self._tracked.pop(request_id, None)

    def start_fill(self, rows: list[ConstrainedRow]) -> None:
        """Starts filling the bitmask of this step's constrained rows on the fill thread."""
        self._wait_fill()
        self._fill = self._filler.submit(self._fill_host, rows)

    def bitmask(self, rows: list[ConstrainedRow], num_logits_rows: int) -> TokenBitmask:
        """The bitmask start_fill(rows) began, copied to the device without blocking; waits for
        the fill (releasing the GIL)."""
        self._wait_fill()
        n = len(rows)
        words = self._words[:n]
        words.copy_(self._host[:n], non_blocking=True)
        if n == num_logits_rows:  # every row constrained, in order
            bitmask = TokenBitmask(None, words)
        else:
            row_ids = self._row_ids[:n]
            row_ids.copy_(self._rows[:n], non_blocking=True)
            bitmask = TokenBitmask(row_ids, words)
        if words.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return bitmask

    def record_sampled(
        self,
        rows: list[ConstrainedRow],
        token_ids: torch.Tensor,
        done: torch.cuda.Event | None,
    ) -> None:
        """token_ids: every sampling row's next id on the host, valid once `done` happened."""
        ids = [row.request_id for row in rows]
        self._sampled = _Sampled(ids, [row.sampling_row for row in rows], token_ids, done)

    def _wait_fill(self) -> None:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill.result()

    def _fill_host(self, rows: list[ConstrainedRow]) -> None:
        """On the fill thread: the rows' masks in the pinned host buffer, all tokens allowed
        where a request's grammar no longer constrains it."""
        with torch.inference_mode():
            self._take_sampled()
            tracked = [self._tracked_for(row) for row in rows]
            live = [i for i, t in enumerate(tracked) if t.constrains]
            if self._copied is not None:
                self._copied.synchronize()
            n = len(rows)
            self._host[:n] = -1  # every token allowed
            if live:
                matchers = [tracked[i].matcher for i in live]
                self._batch.batch_fill_next_token_bitmask(matchers, self._host, indices=live)
            for i in live:
                if (token_id := tracked[i].reasoning.opening_token) is not None:
                    _allow(self._host[i], token_id)
            self._rows[:n] = torch.tensor([row.logits_row for row in rows])

    def _take_sampled(self) -> None:
        sampled, self._sampled = self._sampled, None
        if sampled is None:
            return
        if sampled.done is not None:
            sampled.done.synchronize()
        token_ids = sampled.token_ids.tolist()
        for request_id, position in zip(sampled.request_ids, sampled.positions):
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                tracked.accept(token_ids[position])

    def _tracked_for(self, row: ConstrainedRow) -> _Tracked:
        """The row's matcher at the row's output length; a request without one, or whose matcher
        is off by a token (a preempted request's token in flight was dropped), starts one from its
        outputs."""
        tracked = self._tracked.get(row.request_id)
        if tracked is None or tracked.num_accepted != row.num_output_tokens:
            tracked = self._tracked[row.request_id] = _Tracked(row)
        return tracked


def _allow(mask_row: torch.Tensor, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = (int(mask_row[word]) | (1 << bit)) & 0xFFFFFFFF
    mask_row[word] = value - (1 << 32) if value >= 1 << 31 else value
