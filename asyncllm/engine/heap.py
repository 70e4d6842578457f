"""Giving freed heap memory back to the OS when the engine goes idle.

glibc's malloc keeps much of what a burst of steps freed (tensors of many sizes, allocated from
several threads) resident inside its arenas. Measured on the tiny test model's server after
500-stream disconnect storms: 830-870 MiB resident without the trim, 700-720 MiB with it. The
trim took 5-10 ms after a storm and about 0.1 ms with nothing to give back, which is why it
runs only when the engine is about to wait for work."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
