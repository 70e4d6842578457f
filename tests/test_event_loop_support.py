"""A helper the event-loop responsiveness tests share. No tests here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def ticking_while(work: Awaitable[T], tick_s: float) -> tuple[T, list[float]]:
    """Awaits work while a ticker sleeps tick_s at a time in the same event loop: work's result
    and the seconds between ticks (a gap much longer than tick_s: the loop was held)."""
    task = asyncio.ensure_future(work)
    gaps: list[float] = []
    last = time.monotonic()
    while not task.done():
        await asyncio.sleep(tick_s)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    return await task, gaps
