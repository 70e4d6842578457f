"""The grammar state of each constrained request on the worker. Each step's token bitmask is
filled on the host after the step's forward pass is enqueued, so it is computed while the device
runs; the tokens the step before sampled are taken in first (waiting for them, if that step
still runs)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from asyncllm.sample.grammar_mask import TokenBitmask

logger = logging.getLogger(__name__)


@dataclass
class ConstrainedRow:
    logits_row: int
    request_id: str
    grammar: xgr.CompiledGrammar
    # the outputs this row's sample follows; read only to start a matcher, which happens when
    # they are all on the host (a prompt completed, after admission or preemption)
    output_token_ids: Sequence[int]
    num_output_tokens: int


def constrained_rows(scheduled: list) -> list[ConstrainedRow]:
    """The rows (ScheduledRequests, one per logits row) whose request has a grammar."""
    rows = []
    for logits_row, s in enumerate(scheduled):
        request = s.request
        if request.grammar is not None:
            num_outputs = s.num_computed_tokens + s.num_new_tokens - request.num_prompt_tokens
            rows.append(
                ConstrainedRow(
                    logits_row,
                    request.request_id,
                    request.grammar,
                    request.output_token_ids,
                    num_outputs,
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
    def __init__(self, grammar: xgr.CompiledGrammar, output_token_ids: Sequence[int]) -> None:
        self.matcher = xgr.GrammarMatcher(grammar)
        self.num_accepted = 0
        self.broken = False  # took a token its grammar forbids: no longer constrained
        for token_id in output_token_ids:
            self.accept(token_id)

    def accept(self, token_id: int) -> None:
        self.num_accepted += 1
        if self.broken or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            logger.warning(
                "a constrained request took token %d, which its grammar forbids", token_id
            )
            self.broken = True

    @property
    def constrains(self) -> bool:
        return not (self.broken or self.matcher.is_terminated())


class GrammarMatchers:
    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._host = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self._rows = torch.zeros(max_rows, dtype=torch.int64)
        if pin:
            self._host, self._rows = self._host.pin_memory(), self._rows.pin_memory()
        self._words = torch.zeros(self._host.shape, dtype=torch.int32, device=device)
        self._row_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._batch = xgr.BatchGrammarMatcher()
        self._tracked: dict[str, _Tracked] = {}
        self._sampled: _Sampled | None = None

    def forget(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._tracked.pop(request_id, None)

    def bitmask(self, rows: list[ConstrainedRow], num_logits_rows: int) -> TokenBitmask | None:
        """The bitmask of this step's constrained rows, copied to the device without blocking."""
        if not rows:
            return None
        self._take_sampled()
        tracked = [self._tracked_for(row) for row in rows]
        live = [i for i, t in enumerate(tracked) if t.constrains]
        self._host[: len(rows)] = -1  # every token allowed
        if live:
            matchers = [tracked[i].matcher for i in live]
            self._batch.batch_fill_next_token_bitmask(matchers, self._host, indices=live)
        self._rows[: len(rows)] = torch.tensor([row.logits_row for row in rows])
        n = len(rows)
        words = self._words[:n]
        words.copy_(self._host[:n], non_blocking=True)
        if n == num_logits_rows:  # every row constrained, in order
            return TokenBitmask(None, words)
        row_ids = self._row_ids[:n]
        row_ids.copy_(self._rows[:n], non_blocking=True)
        return TokenBitmask(row_ids, words)

    def record_sampled(
        self,
        rows: list[ConstrainedRow],
        token_ids: torch.Tensor,
        done: torch.cuda.Event | None,
    ) -> None:
        """token_ids: every logits row's sampled id on the host, valid once `done` happened."""
        ids = [row.request_id for row in rows]
        self._sampled = _Sampled(ids, [row.logits_row for row in rows], token_ids, done)

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
            outputs = row.output_token_ids[: row.num_output_tokens]
            tracked = self._tracked[row.request_id] = _Tracked(row.grammar, outputs)
        return tracked
