"""What the sampling kernels take of a batch, as plain data: each row's mode, its Philox key and
the penalties, importable without triton (the CPU samplers build them too)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# a row's mode: greedy rows take the argmax; RACE rows sample in prepare_logits, MASKED ones in
# sample_masked, where GREEDY_MASKED ones get their cutoff on request (processed logprobs)
GREEDY, RACE, MASKED, GREEDY_MASKED = 0, 1, 2, 3


@dataclass(frozen=True)
class RowKeys:
    """Each row's Philox key: (seed, num_sampled + step) where seeded, else (fresh_seed, row)."""

    seed: torch.Tensor  # int64 [B]
    seeded: torch.Tensor  # int8 [B]
    num_sampled: torch.Tensor  # int64 [B]: tokens the row's request had sampled at step 0
    step: int
    fresh_seed: int


@dataclass(frozen=True)
class Penalties:
    """The penalties of a batch and its requests' token history (one slot each)."""

    rows: torch.Tensor  # int64 [P]: the rows with a penalty
    slot: torch.Tensor  # int32 [B]: the row's slot; -1 where it has no penalty
    presence: torch.Tensor  # float32 [B], 0 where off
    frequency: torch.Tensor  # float32 [B], 0 where off
    repetition: torch.Tensor  # float32 [B], 1 where off
    counts: torch.Tensor  # int32 [S, V]: output token counts
    seen: torch.Tensor  # uint8 [S, V]: 1 on prompt tokens (where there is a repetition penalty)
    tokens: torch.Tensor  # int32 [S, L]: the distinct tokens counted or seen, lengths[s] of them
    lengths: torch.Tensor  # int32 [S, 1]
