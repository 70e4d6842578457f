"""The engine's supervisor: a dead engine core is replaced by a new one (--engine-restart), at
most --engine-restarts-per-minute times in any 60 s; past that, or with restarts off, the server
stays up with /health answering 503 so that a load balancer sends its traffic elsewhere."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from asyncllm.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

WINDOW_S = 60.0


class RestartLimit:
    """At most `per_window` restarts in any WINDOW_S seconds."""

    def __init__(self, per_window: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_window = per_window
        self.clock = clock
        self._times: collections.deque[float] = collections.deque()

    def take(self) -> bool:
        """Counts one restart; False (counting nothing) when the window is full."""
        now = self.clock()
        while self._times and now - self._times[0] >= WINDOW_S:
            self._times.popleft()
        if len(self._times) >= self.per_window:
            return False
        self._times.append(now)
        return True


async def supervise(engine: AsyncLLM, restart: bool, limit: RestartLimit) -> None:
    """Runs for the server's life: restarts the engine each time it dies, while allowed."""
    while True:
        error = await engine.wait_until_dead()
        if not restart:
            logger.error("the engine core died (%r); --no-engine-restart: it stays down", error)
            return
        if not limit.take():
            logger.error(
                "the engine core died (%r), past %d restarts a minute: it stays down",
                error,
                limit.per_window,
            )
            return
        logger.warning("the engine core died (%r); starting a new one", error)
        started = time.monotonic()
        try:
            await engine.restart()
        except Exception:
            logger.exception("the new engine core did not start")
            continue
        logger.info("a new engine core serves, %.1f s after the death", time.monotonic() - started)


def start_supervisor(engine: AsyncLLM, restart: bool, per_minute: int) -> asyncio.Task:
    engine.start()
    return asyncio.get_running_loop().create_task(
        supervise(engine, restart, RestartLimit(per_minute))
    )
