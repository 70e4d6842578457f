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
    # int32 [R, W]: bit j of word w allows token 32 * w + j; the tokens past 32 * W (the logits'
    # padding past the tokenizer's vocabulary) are forbidden
    words: torch.Tensor


def apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask) -> None:
    """In place, on the logits' device."""
    vocab = logits.shape[-1]
    bits = torch.ones((), dtype=torch.int32, device=logits.device) << torch.arange(
        _BITS, device=logits.device, dtype=torch.int32
    )
    allowed = (bitmask.words.unsqueeze(-1) & bits) != 0
    forbidden = ~allowed.view(allowed.shape[0], -1)[:, :vocab]
    if bitmask.rows is None:
        _forbid(logits, forbidden)
        return
    rows = logits.index_select(0, bitmask.rows)
    _forbid(rows, forbidden)
    logits.index_copy_(0, bitmask.rows, rows)


def _forbid(logits: torch.Tensor, forbidden: torch.Tensor) -> None:
    """-inf at the forbidden tokens and past the columns `forbidden` covers."""
    covered = forbidden.shape[1]
    logits[:, :covered].masked_fill_(forbidden, float("-inf"))
    logits[:, covered:] = float("-inf")
