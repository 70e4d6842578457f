"""The grammar's hook in the sampler: tokens a constrained row's grammar forbids get -inf before
anything else looks at the logits (raw logprobs included, as in vLLM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = 32


@dataclass
class TokenBitmask:
    rows: torch.Tensor  # int64 [R]: the logits rows a grammar constrains
    words: torch.Tensor  # int32 [R, ceil(V / 32)]: bit j of word w allows token 32 * w + j


def apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask) -> None:
    """In place, on the logits' device."""
    vocab = logits.shape[-1]
    shifts = torch.arange(_BITS, device=logits.device, dtype=torch.int32)
    bits = (bitmask.words.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(bits.shape[0], -1)[:, :vocab].bool()
    rows = logits.index_select(0, bitmask.rows)
    logits.index_copy_(0, bitmask.rows, rows.masked_fill_(~allowed, float("-inf")))
