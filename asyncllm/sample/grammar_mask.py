"""The grammars' hook in sampling: tokens a constrained row's grammar forbids get -inf before the
sampler looks at the logits (so raw logprobs see the mask too, as in vLLM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = 32


@dataclass
class TokenBitmask:
    # int64 [R]: the logits rows a grammar constrains; None: every row, in order
    rows: torch.Tensor | None
    words: torch.Tensor  # int32 [R, ceil(V / 32)]: bit j of word w allows token 32 * w + j


def apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask) -> None:
    """In place, on the logits' device."""
    vocab = logits.shape[-1]
    bits = torch.ones((), dtype=torch.int32, device=logits.device) << torch.arange(
        _BITS, device=logits.device, dtype=torch.int32
    )
    allowed = (bitmask.words.unsqueeze(-1) & bits) != 0
    forbidden = ~allowed.view(allowed.shape[0], -1)[:, :vocab]
    if bitmask.rows is None:
        logits.masked_fill_(forbidden, float("-inf"))
        return
    rows = logits.index_select(0, bitmask.rows)
    logits.index_copy_(0, bitmask.rows, rows.masked_fill_(forbidden, float("-inf")))
