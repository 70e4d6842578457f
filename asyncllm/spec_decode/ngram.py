"""Prompt lookup (n-gram) drafting on the device: the tokens that followed the latest earlier
occurrence of the request's last n tokens, for n from prompt_lookup_max down to
prompt_lookup_min.

Each request's tokens are kept in a table on the device, a row per input-batch row, written
from every step's inputs and sampled tokens (and, for a request new to its row, from the host's
tokens before its first step), so drafting needs nothing from the host: the next step can be
scheduled, with its drafts still on the device, before this one has returned.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.config import SpeculativeConfig
from asyncllm.sample.history import to_device
from asyncllm.spec_decode.draft_step import DraftBatch, DraftKVCache


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
        follows = _latest_longest_match(history, lengths, self.min_n, self.max_n)
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


def _latest_longest_match(
    history: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int
) -> torch.Tensor:
    """[R]: where the drafts of each row start (-1: none), after the latest earlier window of
    its last n tokens, n the largest from max_n down to min_n that has one. A window is taken
    by its last token e (before the row's last): it matches for every n up to the run of
    tokens equal to the row's last ones going back from e, so one pass finds them all."""
    width, device = history.shape[1], history.device
    run = torch.zeros_like(history)
    alive = torch.ones_like(history, dtype=torch.bool)
    for back in range(max_n):
        # shifted[e] = history[e - back]; -1 before the row's first token matches nothing
        shifted = torch.nn.functional.pad(history, (back, 0), value=-1)[:, :width]
        last = history.gather(1, (lengths - 1 - back).clamp(min=0)[:, None])
        last = torch.where((lengths - 1 - back >= 0)[:, None], last, -2)
        alive &= shifted == last
        run += alive
    ends = torch.arange(width, device=device)
    run = torch.where(ends < (lengths - 1)[:, None], run, 0)
    # the longest run first (capped at max_n), then the latest end
    best = (run * width + ends).amax(dim=1)
    longest, end = best // width, best % width
    return torch.where(longest >= min_n, end + 1, -1)
