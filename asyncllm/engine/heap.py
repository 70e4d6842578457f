"""Memory housekeeping of the long-lived processes (the server, the engine core's process).

Freed heap back to the OS when the engine goes idle: glibc's malloc keeps much of what a burst
of steps freed (tensors of many sizes, allocated from several threads) resident inside its
arenas. Measured on the tiny test model's server after 500-stream disconnect storms: 830-870 MiB
resident without the trim, 700-720 MiB with it. The trim took 5-10 ms after a storm and about
0.1 ms with nothing to give back, which is why it runs only when the engine is about to wait.

One malloc arena in these processes: each thread that allocates gets an arena of its own
(the engine core's stepping thread, the tokenizer's, the collectors), and malloc_trim gives
back only the free chunks inside the other arenas, not their tops, which keep what a peak
left there (glibc raises its trim threshold to twice the largest mmapped block freed, up to
64 MiB). Measured on the tiny model's server (2 cores, load 7-9): RSS after each of 500-stream
disconnect storms 687 -> 710 -> 712 -> 712 -> 713 MiB with an arena per thread (the growth in
the threads' arenas, malloc's own count flat), 686 -> 687 -> 688 -> 688 with one. An operator's
MALLOC_ARENA_MAX is left as set.

The objects of start-up frozen out of the garbage collector's reach: a full collection walks
every tracked object, and the server holds some 320,000 after loading (modules, tokenizer,
model); under load three full collections paused its event loop for up to 256 ms each.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import os

_M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where the C library is another (macOS, musl)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 (glibc's, not only any libc's)
    except (OSError, AttributeError):
        return None
    return libc


def use_one_malloc_arena() -> None:
    """Call first thing in a long-lived process, before its threads allocate."""
    libc = _libc()
    if libc is not None and "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(_M_ARENA_MAX, 1)


def release_freed_memory() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def freeze_startup_objects() -> None:
    """Call once start-up is done: what is alive now stays, and later collections skip it.
    They are thawed at exit, so that the interpreter's last collection still finalizes them
    (frozen, triton's extension objects report themselves leaked)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
