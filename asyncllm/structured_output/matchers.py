"""The grammar state of each constrained request on the worker. A step's token bitmask is filled
on a thread of its own while the device runs the step's forward pass (on CPU, while the runner
runs it): the fill first takes in the tokens the step before sampled (waiting for them, if that step still
runs), then fills every row's mask with xgrammar's batched fill, on several threads. A request
verifying drafts has a row of logits per draft position and one after: row j gets the mask of
its state after drafts[:j] (the engine core cut the drafts to those its grammar takes). The
runner waits for the fill only when the sampler needs the mask: on the thread that waits for the
step (the model runner's deferred sampling), not the one that launches the next.

Invariant: a fill starts in a step's launch and ends before that step's sampling is enqueued,
which the next launch waits for, so the matchers are never touched by two threads at once."""

from __future__ import annotations

import concurrent.futures
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from asyncllm.sample.grammar_mask import TokenBitmask
from asyncllm.sampling_params import ReasoningMarkers
from asyncllm.structured_output.state import GrammarState, accept_in_batch

# xgrammar's "auto" takes half of std::thread::hardware_concurrency(), the host's cores rather
# than those this process may use. The fill holds the GIL throughout, and more threads made it
# slower: 256 rows on the H200's 16-core host took 1.12 ms on 1 thread, 0.92 on 2, 1.00 on 4,
# 2.61 on 8 (bench/results/structured_accept_fill_real_tokenizer_h200host.json)
_CORES_PER_FILL_THREAD = 8
_MAX_FILL_THREADS = 4


def fill_threads() -> int:
    """Threads for the batched bitmask fill: one per 8 cores this process may run on, 1 to 4."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(_MAX_FILL_THREADS, cores // _CORES_PER_FILL_THREAD))


@dataclass
class ConstrainedRow:
    sampling_row: int  # of the step's sampled ids
    logits_row: int  # the first of the row's logits (a verify step scores 1 + drafts rows)
    request_id: str
    grammar: xgr.CompiledGrammar
    # the outputs this row's sample follows; read only to start a matcher, which happens when
    # they are all on the host (a prompt completed, after admission or preemption)
    output_token_ids: Sequence[int]
    num_output_tokens: int
    prompt_token_ids: Sequence[int]
    reasoning: ReasoningMarkers | None
    drafts: Sequence[int] = field(default_factory=list)  # verified this step

    @property
    def masked_rows(self) -> range:
        """The logits rows of the request's positions: one per draft and the one after."""
        return range(self.logits_row, self.logits_row + len(self.drafts) + 1)


def constrained_rows(scheduled: list, logits_rows: list[int]) -> list[ConstrainedRow]:
    """The rows of the sampling requests (ScheduledRequests) whose request has a grammar."""
    rows = []
    for sampling_row, (s, logits_row) in enumerate(zip(scheduled, logits_rows)):
        request = s.request
        if request.grammar is not None:
            num_drafts = len(s.spec_token_ids)
            num_outputs = (
                s.num_computed_tokens + s.num_new_tokens - num_drafts - request.num_prompt_tokens
            )
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
                    s.spec_token_ids,
                )
            )
    return rows


@dataclass
class _Sampled:
    """Ids a launched step sampled for constrained requests, readable once `done` happened."""

    request_ids: list[str]
    positions: list[int]  # of each request's first id in token_ids
    sampling_rows: list[int]  # of each request, in num_accepted
    token_ids: torch.Tensor  # host, int64
    # host, int64, per sampling row: the drafts a verify step accepted, followed in token_ids
    # by the token sampled after them; None for a step without drafts
    num_accepted: torch.Tensor | None
    done: torch.cuda.Event | None


def _start(row: ConstrainedRow) -> GrammarState:
    state = GrammarState(row.grammar, row.reasoning, row.prompt_token_ids)
    state.accept_all(row.output_token_ids[: row.num_output_tokens])
    return state


class GrammarMatchers:
    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        """vocab_size: the grammars' vocabulary (the tokenizer's), the bitmask's width; the
        logits past it are forbidden where the mask is applied."""
        pin = device.type == "cuda"
        self.vocab_size = vocab_size
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
        self._tracked: dict[str, GrammarState] = {}
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
        n = _num_masked(rows)
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
        num_accepted: torch.Tensor | None,
        done: torch.cuda.Event | None,
    ) -> None:
        """On the host, valid once `done` happened: token_ids, the id sampled at every logits
        row; num_accepted, for a verify step, each sampling row's accepted drafts (the matcher
        takes those and the token after them)."""
        ids = [row.request_id for row in rows]
        positions = [row.logits_row for row in rows]
        sampling_rows = [row.sampling_row for row in rows]
        self._sampled = _Sampled(ids, positions, sampling_rows, token_ids, num_accepted, done)

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
            if self._copied is not None:
                self._copied.synchronize()
            masked = [i for row in rows for i in row.masked_rows]
            self._host[: len(masked)] = -1  # every token allowed
            try:
                self._fill_positions(rows, tracked)
            finally:
                for state in tracked:
                    state.roll_back_drafts()
            self._rows[: len(masked)] = torch.tensor(masked)

    def _fill_positions(self, rows: list[ConstrainedRow], tracked: list[GrammarState]) -> None:
        """One batched fill per draft position, of each request's state after its drafts
        before that position (as far as its grammar takes them)."""
        firsts = itertools.accumulate((len(row.masked_rows) for row in rows), initial=0)
        pending = list(zip(tracked, firsts, (row.drafts for row in rows)))
        for j in range(max(len(row.drafts) for row in rows) + 1):
            self._fill_batched([(state, first + j) for state, first, _ in pending])
            pending = [
                (state, first, drafts)
                for state, first, drafts in pending
                if j < len(drafts) and state.take_draft(drafts[j])
            ]

    def _fill_batched(self, rows: list[tuple[GrammarState, int]]) -> None:
        """(state, buffer row) pairs."""
        live = [(state, index) for state, index in rows if state.constrains]
        if live:
            matchers, indices = [s.matcher for s, _ in live], [i for _, i in live]
            self._batch.batch_fill_next_token_bitmask(matchers, self._host, indices=indices)
        for state, index in live:
            self._allow_opening(state, index)

    def _allow_opening(self, state: GrammarState, index: int) -> None:
        if (token_id := state.reasoning.opening_token) is not None:
            _allow(self._host[index], token_id)

    def _take_sampled(self) -> None:
        sampled, self._sampled = self._sampled, None
        if sampled is None:
            return
        if sampled.done is not None:
            sampled.done.synchronize()
        token_ids = sampled.token_ids.tolist()
        accepted = None if sampled.num_accepted is None else sampled.num_accepted.tolist()
        moves = []
        for request_id, position, row in zip(
            sampled.request_ids, sampled.positions, sampled.sampling_rows
        ):
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                num_taken = 1 + (0 if accepted is None else accepted[row])
                moves.append((tracked, token_ids[position : position + num_taken]))
        accept_in_batch(moves)

    def _tracked_for(self, row: ConstrainedRow) -> GrammarState:
        """The row's matcher at the row's output length; a request without one, or whose matcher
        is off by a token (a preempted request's token in flight was dropped), starts one from its
        outputs."""
        tracked = self._tracked.get(row.request_id)
        if tracked is None or tracked.num_accepted != row.num_output_tokens:
            tracked = self._tracked[row.request_id] = _start(row)
        return tracked


def _num_masked(rows: list[ConstrainedRow]) -> int:
    return sum(len(row.masked_rows) for row in rows)


def _allow(mask_row: torch.Tensor, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = (int(mask_row[word]) | (1 << bit)) & 0xFFFFFFFF
    mask_row[word] = value - (1 << 32) if value >= 1 << 31 else value
