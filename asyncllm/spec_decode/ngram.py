"""Prompt lookup (n-gram) drafting on the device: the tokens that followed the latest earlier
occurrence of the request's last n tokens, for n from prompt_lookup_max down to
prompt_lookup_min.

Each request's tokens are kept in a table on the device, a row per input-batch row, written
from every step's inputs and sampled tokens (and, for a request new to its row, from the host's
tokens before its first step), so drafting needs nothing from the host: the next step can be
scheduled, with its drafts still on the device, before this one has returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.config import SpeculativeConfig
from asyncllm.sample.history import to_device
from asyncllm.spec_decode.draft_step import DraftKVCache


@dataclass
class DraftBatch:
    """What a proposer on the device sees of a step: where its input tokens went, the tokens
    of requests new to their rows, and each sampling row's next token."""

    input_ids: torch.Tensor  # [T] the step's input tokens (no padding)
    positions: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T] each token's input-batch row
    known: list[tuple[int, list[int]]]  # (row, the tokens before the step) of rows new to it
    rows: torch.Tensor  # [R] each sampling row's input-batch row
    next_token_ids: torch.Tensor  # [R]
    next_positions: torch.Tensor  # [R]
    max_len: int  # at least every sampling row's token count after the step


class NgramProposer:
    drafts_on_device = True
    reads_hidden = False
    aux_layers: tuple[int, ...] = ()

    def __init__(
        self, config: SpeculativeConfig, num_rows: int, max_model_len: int, device: torch.device
    ) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.tokens = torch.zeros(num_rows, max_model_len, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.kv_cache = DraftKVCache([], torch.int32, device)  # none

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        """[R, num_speculative_tokens] drafts, -1 past the ones found."""
        self._record(batch)
        history = self.tokens[batch.rows, : batch.max_len].long()
        lengths = self.lengths.index_select(0, batch.rows)
        follows = torch.full_like(lengths, -1)  # where each row's drafts start
        for n in range(self.max_n, self.min_n - 1, -1):
            latest = _latest_match(history, lengths, n)
            follows = torch.where((follows < 0) & (latest >= 0), latest + n, follows)
        at = follows[:, None] + torch.arange(self.num_tokens, device=history.device)
        found = (follows[:, None] >= 0) & (at < lengths[:, None])
        drafts = history.gather(1, at.clamp(0, history.shape[1] - 1))
        return torch.where(found, drafts, -1)

    def _record(self, batch: DraftBatch) -> None:
        if batch.known:
            rows = np.concatenate([np.full(len(t), row) for row, t in batch.known])
            positions = np.concatenate([np.arange(len(t)) for _, t in batch.known])
            ids = np.concatenate([t for _, t in batch.known])
            flat = to_device(np.stack([rows, positions, ids]).astype(np.int64), self.tokens.device)
            self.tokens[flat[0], flat[1]] = flat[2].int()
        self.tokens[batch.token_rows, batch.positions] = batch.input_ids.int()
        self.tokens[batch.rows, batch.next_positions] = batch.next_token_ids.int()
        self.lengths[batch.rows] = batch.next_positions + 1


def _latest_match(history: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """[R]: the start of the latest window of n tokens before each row's last n that equals
    them (-1: none), over a row's first lengths[r] tokens."""
    width = history.shape[1]
    if n >= width:
        return torch.full_like(lengths, -1)
    device = history.device
    last = (lengths[:, None] - n + torch.arange(n, device=device)).clamp(min=0)
    suffix = history.gather(1, last)
    # windows of every token but the last, as the starts of those that may match
    windows = history[:, :-1].unfold(1, n, 1)
    matches = (windows == suffix[:, None, :]).all(dim=-1)
    starts = torch.arange(matches.shape[1], device=device)
    matches &= starts <= (lengths - 1 - n)[:, None]
    return torch.where(matches, starts, -1).amax(dim=1)
