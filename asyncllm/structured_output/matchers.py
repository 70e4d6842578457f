"""The grammar state of each constrained request on the worker. A step's token bitmask is filled
on a thread of its own while the device runs the step's forward pass (on CPU, while the runner
runs it): the fill first takes in the tokens the step before sampled (waiting for them, if that
step still runs), then fills every row's mask with xgrammar's batched fill, on several threads.
A request verifying drafts has a row of logits per draft position and one after: row j gets the
mask of its state after drafts[:j] (the engine core cut the drafts to those its grammar takes).
The runner waits for the fill only when the sampler needs the mask: on the thread that waits for
the step (the model runner's deferred sampling), not the one that launches the next.

xgrammar holds the GIL for its whole calls, which the engine core's thread needs meanwhile: on a
host with the cores for it, a grammar process (grammar_process.py) takes each request over once
it has compiled its constraint, and fills its rows beside this process; until then, and if that
process dies, the request is matched here.

Invariant: a fill starts in a step's launch and ends before that step's sampling is enqueued,
which the next launch waits for, so the matchers are never touched by two threads at once."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from asyncllm.sample.grammar_mask import TokenBitmask
from asyncllm.sampling_params import ReasoningMarkers, StructuredOutputsParams
from asyncllm.structured_output.grammar_process import Adopt, GrammarProcess, RemoteRow, Step
from asyncllm.structured_output.masks import fill_masks
from asyncllm.structured_output.state import GrammarState, accept_in_batch

# xgrammar's "auto" takes half of std::thread::hardware_concurrency(), the host's cores rather
# than those this process may use. The fill holds the GIL throughout, and more threads made it
# slower: 256 rows on the H200's 16-core host took 1.12 ms on 1 thread, 0.92 on 2, 1.00 on 4,
# 2.61 on 8 (bench/results/structured_accept_fill_real_tokenizer_h200host.json)
_CORES_PER_FILL_THREAD = 8
_MAX_FILL_THREADS = 4
# the grammar process takes a core of its own, beside the core's thread, the collector, the fill
# thread and the fill's threads
_MIN_CORES_FOR_PROCESS = 8

logger = logging.getLogger(__name__)


def fill_threads() -> int:
    """Threads for the batched bitmask fill: one per 8 cores this process may run on, 1 to 4."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(_MAX_FILL_THREADS, cores // _CORES_PER_FILL_THREAD))


def wants_grammar_process() -> bool:
    """Whether this process may run on enough cores to give the grammars a process."""
    return len(os.sched_getaffinity(0)) >= _MIN_CORES_FOR_PROCESS


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
    # what the grammar was compiled from, for the grammar process to compile it again
    constraint: StructuredOutputsParams | None = None

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
                    request.sampling_params.structured_outputs,
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
    def __init__(
        self,
        vocab_size: int,
        max_rows: int,
        device: torch.device,
        vocabulary: Callable[[], xgr.TokenizerInfo] | None = None,
    ) -> None:
        """vocab_size: the grammars' vocabulary (the tokenizer's), the bitmask's width; the
        logits past it are forbidden where the mask is applied. With `vocabulary` (what the
        grammars were compiled against), a grammar process takes the requests over once it has
        compiled their constraints."""
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
        self._process: GrammarProcess | None = None
        if vocabulary is not None:
            self._process = _start_process(vocabulary, self._host.shape, self.num_threads)
        # the requests the process holds, and how many tokens each was sent
        self._remote: dict[str, int] = {}
        self._ready: set[str] = set()  # of those, the ones whose grammar it has compiled
        self._step = Step()  # the next message to the process

    @property
    def process(self) -> GrammarProcess | None:
        return self._process

    @property
    def num_held_by_process(self) -> int:
        """The requests whose rows the grammar process fills (it has compiled their grammar)."""
        return len(self._ready)

    def close(self) -> None:
        """Ends the grammar process, if there is one."""
        self._wait_fill()
        if self._process is not None:
            self._drop_process()

    def forget(self, request_ids: set[str]) -> None:
        self._wait_fill()
        for request_id in request_ids:
            self._tracked.pop(request_id, None)
            if self._remote.pop(request_id, None) is not None:
                self._step.forget.append(request_id)
                self._ready.discard(request_id)
        # what is still to be sent of them (before the process has started): the process
        # takes the forgetting first
        step = self._step
        step.adopt = [a for a in step.adopt if a.request_id not in request_ids]
        step.accepts = [(i, t) for i, t in step.accepts if i not in request_ids]

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
        where a request's grammar no longer constrains it. The rows the grammar process holds
        are filled there meanwhile, and copied over."""
        with torch.inference_mode():
            self._take_sampled()
            sizes = [len(row.drafts) + 1 for row in rows]
            firsts = list(itertools.accumulate(sizes, initial=0))
            num_masked = firsts.pop()
            local, remote = [], []
            for row, first in zip(rows, firsts):
                if self._held_remotely(row):
                    remote.append((row.request_id, first, row.drafts))
                else:
                    local.append((row, first))
            tracked = [self._tracked_for(row) for row, _ in local]
            sent = self._send_step(remote)
            if self._copied is not None:
                self._copied.synchronize()
            if local:
                self._host[:num_masked] = -1  # every token allowed
                firsts, drafts = [f for _, f in local], [row.drafts for row, _ in local]
                fill_masks(self._batch, self._host, tracked, firsts, drafts)
            if sent:
                self._receive_step(remote, num_masked)
            masked = [row.logits_row + j for row, size in zip(rows, sizes) for j in range(size)]
            self._rows[:num_masked] = torch.tensor(masked)

    def _held_remotely(self, row: ConstrainedRow) -> bool:
        """Whether the grammar process fills the row: it has compiled the request's grammar and
        holds its state at the row's output length (this process's state is let go)."""
        request_id = row.request_id
        held = request_id in self._ready and self._remote[request_id] == row.num_output_tokens
        if held:
            self._tracked.pop(request_id, None)
        return held

    def _send_step(self, remote: list[RemoteRow]) -> bool:
        """Whether the step went to the process (not before it has started: the step's
        adoptions and tokens wait for the next)."""
        if self._process is None:
            return False
        try:
            if not self._process.started():
                return False
            self._step.rows = remote
            step, self._step = self._step, Step()
            self._process.send(step)
        except (OSError, EOFError) as e:
            self._lose_process(e)
            return False
        return True

    def _receive_step(self, remote: list[RemoteRow], num_masked: int) -> None:
        """The process's masks of the remote rows copied into the host buffer."""
        try:
            ready = self._process.receive()
        except (OSError, EOFError, RuntimeError) as e:
            self._lose_process(e)
            return
        self._ready.update(i for i in ready if i in self._remote)
        masks = self._process.masks
        indices = [first + j for _, first, drafts in remote for j in range(len(drafts) + 1)]
        if len(indices) == num_masked:  # every row, in order
            self._host[:num_masked] = masks[:num_masked]
        elif indices:
            at = torch.tensor(indices)
            self._host[at] = masks[at]

    def _lose_process(self, error: BaseException) -> None:
        """From now on the requests are matched in this process. Those it had taken over fail
        with this step: they cannot be followed from here (their outputs may still be on the
        device)."""
        logger.error("the grammar process failed (%s): grammars are matched here now", error)
        taken_over = bool(self._ready)
        self._drop_process()
        if taken_over:
            raise RuntimeError(f"the grammar process failed: {error}") from error

    def _drop_process(self) -> None:
        """The requests are matched here from now on (those it held restart from their
        outputs)."""
        self._process.close()
        self._process = None
        self._remote.clear()
        self._ready.clear()
        self._step = Step()

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
            num_taken = 1 + (0 if accepted is None else accepted[row])
            taken = token_ids[position : position + num_taken]
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                moves.append((tracked, taken))
            if request_id in self._remote:
                self._step.accepts.append((request_id, taken))
                self._remote[request_id] += num_taken
        accept_in_batch(moves)

    def _tracked_for(self, row: ConstrainedRow) -> GrammarState:
        """The row's matcher at the row's output length; a request without one, or whose matcher
        is off by a token (a preempted request's token in flight was dropped), starts one from its
        outputs."""
        tracked = self._tracked.get(row.request_id)
        if tracked is None or tracked.num_accepted != row.num_output_tokens:
            tracked = self._tracked[row.request_id] = _start(row)
            self._adopt(row)
        return tracked

    def _adopt(self, row: ConstrainedRow) -> None:
        """The grammar process (re)starts the request from the same outputs."""
        if self._process is None or row.constraint is None:
            return
        request_id = row.request_id
        outputs = list(row.output_token_ids[: row.num_output_tokens])
        prompt = list(row.prompt_token_ids)
        adopted = Adopt(request_id, row.constraint, row.reasoning, prompt, outputs)
        self._step.adopt.append(adopted)
        # the tokens taken for its state before are not its new state's
        self._step.accepts = [(i, t) for i, t in self._step.accepts if i != request_id]
        self._remote[request_id] = row.num_output_tokens
        self._ready.discard(request_id)


def _start_process(
    vocabulary: Callable[[], xgr.TokenizerInfo], shape: torch.Size, num_threads: int
) -> GrammarProcess | None:
    """The grammar process, or None where it cannot start (the grammars are matched here)."""
    try:
        return GrammarProcess(vocabulary, (shape[0], shape[1]), num_threads)
    except Exception:
        logger.exception("the grammar process did not start: grammars are matched here")
        return None


def _num_masked(rows: list[ConstrainedRow]) -> int:
    return sum(len(row.masked_rows) for row in rows)
