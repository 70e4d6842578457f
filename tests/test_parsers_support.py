"""Feeding a parser's stream text in random chunk sizes, for the parser tests."""

from __future__ import annotations

import random
from typing import Any


def streamed(stream: Any, text: str, seed: int, max_chunk: int = 7) -> list[Any]:
    """The deltas of feeding text in chunks of 1 to max_chunk characters, then finishing."""
    rng = random.Random(seed)
    deltas, position = [], 0
    while position < len(text):
        size = rng.randint(1, max_chunk)
        deltas.append(stream.feed(text[position : position + size]))
        position += size
    return [*deltas, stream.finish()]
