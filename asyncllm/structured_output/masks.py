"""Token bitmask rows filled from grammar states, in the worker's matchers and in the grammar
process alike: a row per draft position and the one after, row j holding the state's mask after
the drafts before j (as far as its grammar takes them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from asyncllm.structured_output.state import GrammarState


def fill_masks(
    batch: xgr.BatchGrammarMatcher,
    buffer: torch.Tensor,
    states: list[GrammarState],
    firsts: Sequence[int],
    drafts: Sequence[Sequence[int]],
) -> None:
    """One batched fill per draft position into buffer (int32, host), each state's first row at
    its first; rows whose grammar no longer constrains are left as they are. The states' drafts
    are rolled back after."""
    pending = list(zip(states, firsts, drafts))
    try:
        for j in range(max((len(d) for d in drafts), default=0) + 1):
            _fill_batched(batch, buffer, [(state, first + j) for state, first, _ in pending])
            pending = [
                (state, first, row_drafts)
                for state, first, row_drafts in pending
                if j < len(row_drafts) and state.take_draft(row_drafts[j])
            ]
    finally:
        for state in states:
            state.roll_back_drafts()


def allow_all(buffer: torch.Tensor, firsts: Sequence[int], counts: Sequence[int]) -> None:
    """Rows firsts[i] : firsts[i] + counts[i] of buffer allow every token, written a run of
    adjacent rows at a time (one index_put of 256 listed rows took 150 us, a slice 10)."""
    start = end = None
    for first, count in zip(firsts, counts):
        if first != end:
            if start is not None:
                buffer[start:end] = -1
            start = first
        end = first + count
    if start is not None:
        buffer[start:end] = -1


def _fill_batched(
    batch: xgr.BatchGrammarMatcher, buffer: torch.Tensor, rows: list[tuple[GrammarState, int]]
) -> None:
    """(state, buffer row) pairs."""
    live = [(state, index) for state, index in rows if state.constrains]
    if live:
        matchers, indices = [s.matcher for s, _ in live], [i for _, i in live]
        batch.batch_fill_next_token_bitmask(matchers, buffer, indices=indices)
    for state, index in live:
        if (token_id := state.reasoning.opening_token) is not None:
            _allow(buffer[index], token_id)


def _allow(mask_row: torch.Tensor, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = (int(mask_row[word]) | (1 << bit)) & 0xFFFFFFFF
    mask_row[word] = value - (1 << 32) if value >= 1 << 31 else value
