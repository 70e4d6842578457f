"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of
the request's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from asyncllm.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Up to num_speculative_tokens drafts to follow token_ids; [] when no n-gram recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _latest_match(tokens, n)
            if start is not None:
                return tokens[start + n : start + n + self.num_tokens].tolist()
        return []


def _latest_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest window of n tokens before the last n that equals them."""
    suffix = tokens[-n:]
    # candidates: the windows (by start) whose last token is the request's last token
    starts = np.flatnonzero(tokens[n - 1 : -1] == suffix[-1])
    if n > 1 and starts.size:
        windows = sliding_window_view(tokens[:-1], n)[starts]
        starts = starts[(windows == suffix).all(axis=1)]
    return int(starts[-1]) if starts.size else None
