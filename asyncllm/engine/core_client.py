"""How AsyncLLM drives the engine core: in the event loop's own process (LocalCoreClient), or
in a process of its own (CoreProcessClient, the default on CUDA), where stepping the model
never waits for the event loop that streams the outputs. Both take requests, hand back one
CoreStep per engine step, and report EngineStats."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import subprocess
import sys
import threading
from typing import Protocol

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.core.scheduler import check_fits
from asyncllm.engine.core import EngineCore, EngineCoreOutput
from asyncllm.engine.core_process import (
    AddRequest,
    CoreStep,
    EngineStats,
    Failed,
    FinishRequests,
    Ready,
    Shutdown,
)
from asyncllm.engine.heap import release_freed_memory
from asyncllm.request import Request, RequestStatus


class CoreClient(Protocol):
    def add_request(self, request: Request) -> None: ...

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None: ...

    async def get_step(self) -> CoreStep:
        """The next step's outputs; waits while the engine has no work."""
        ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...


class LocalCoreClient:
    """Steps the core from the event loop; the model runs in the runner's thread meanwhile."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        # finished requests are taken out between steps, never while the loop awaits one
        self._pending_finishes: list[tuple[list[str], RequestStatus]] = []
        self._wake = asyncio.Event()

    def add_request(self, request: Request) -> None:
        self.core.add_request(request)
        self._wake.set()

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self._pending_finishes.append((request_ids, status))
        self._wake.set()

    async def get_step(self) -> CoreStep:
        while True:
            for request_ids, status in self._pending_finishes:
                self.core.finish_requests(request_ids, status)
            self._pending_finishes.clear()
            if self.core.has_work():
                # with async scheduling, the step after it is already launched
                return CoreStep(await self.core.step_async())
            self._wake.clear()
            release_freed_memory()
            await self._wake.wait()

    def stats(self) -> EngineStats:
        return EngineStats.of(self.core)

    def shutdown(self) -> None:
        self.core.shutdown()


class EngineCoreGone(RuntimeError):
    """The engine core process failed or exited."""


_CORE_MAIN = "from asyncllm.engine.core_process import main; main()"


class CoreProcessClient:
    """Starts the engine core in a fresh interpreter (core_process.main; unlike multiprocessing's
    spawn, it does not run the caller's main script again) and
    talks to it over two pipes: requests go out from the event loop, steps come back through a
    reader thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.scheduler_config = config.scheduler
        inbox_reader, self._inbox = multiprocessing.Pipe(duplex=False)
        self._outbox, outbox_writer = multiprocessing.Pipe(duplex=False)
        fds = (inbox_reader.fileno(), outbox_writer.fileno())
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CORE_MAIN, *map(str, fds)], pass_fds=fds
        )
        inbox_reader.close()
        outbox_writer.close()
        self._send(config.args)
        self.capacity = self._wait_until_ready()
        self._stats = EngineStats()
        self._steps: asyncio.Queue[CoreStep | Failed] | None = None

    def _wait_until_ready(self) -> Ready:
        try:
            message = self._outbox.recv()
        except EOFError:
            message = Failed(f"the process exited with code {self.process.wait()}")
        if isinstance(message, Failed):
            self.process.wait()
            raise EngineCoreGone(f"the engine core did not start: {message.error}")
        return message

    def add_request(self, request: Request) -> None:
        """Raises ValueError, as the scheduler would, for a request that could never run."""
        check_fits(
            request, self.scheduler_config, self.capacity.num_blocks, self.capacity.block_size
        )
        self._send(AddRequest(request))

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        if not request_ids:
            return
        with contextlib.suppress(OSError):  # a core that is gone holds nothing to free
            self._inbox.send(FinishRequests(list(request_ids), status))

    async def get_step(self) -> CoreStep:
        """The next step, or all the steps that queued up meanwhile, joined."""
        if self._steps is None:
            self._steps = asyncio.Queue()
            self._start_reader(asyncio.get_running_loop(), self._steps)
        steps = [await self._steps.get()]
        while not self._steps.empty():
            steps.append(self._steps.get_nowait())
        for message in steps:
            if isinstance(message, Failed):
                raise EngineCoreGone(f"the engine core process failed: {message.error}")
        step = steps[0] if len(steps) == 1 else join_steps(steps)
        self._stats = step.stats or self._stats
        return step

    def stats(self) -> EngineStats:
        """As of the last step received."""
        return self._stats

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self._inbox.send(Shutdown())
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._inbox.close()

    def _send(self, message: EngineArgs | AddRequest) -> None:
        try:
            self._inbox.send(message)
        except OSError as e:
            raise EngineCoreGone(f"the engine core process is gone: {e!r}") from e

    def _start_reader(
        self, loop: asyncio.AbstractEventLoop, steps: asyncio.Queue[CoreStep | Failed]
    ) -> None:
        def read() -> None:
            message: CoreStep | Failed
            while True:
                try:
                    message = self._outbox.recv()
                except (EOFError, OSError):
                    message = Failed(f"it exited with code {self.process.wait()}")
                try:
                    loop.call_soon_threadsafe(steps.put_nowait, message)
                except RuntimeError:
                    return  # the event loop is closed
                if isinstance(message, Failed):
                    return

        threading.Thread(target=read, name="core-outbox", daemon=True).start()


def join_steps(steps: list[CoreStep]) -> CoreStep:
    """Steps that queued up while the event loop was busy, as one: a request's tokens of
    consecutive steps become one output (one detokenizer update, one stream chunk), so a busy
    front end catches up instead of falling further behind. An output with prompt logprobs
    is not joined to the one before it."""
    outputs: list[EngineCoreOutput] = []
    latest: dict[str, int] = {}  # request id -> index of its last output in outputs
    first_scheduled: dict[str, float] = {}
    for step in steps:
        first_scheduled |= step.first_scheduled
        for out in step.outputs:
            i = latest.get(out.request_id)
            if i is not None and out.new_prompt_logprobs is None:
                outputs[i] = _joined(outputs[i], out)
            else:
                latest[out.request_id] = len(outputs)
                outputs.append(out)
    return CoreStep(outputs, steps[-1].stats, first_scheduled)


def _joined(before: EngineCoreOutput, after: EngineCoreOutput) -> EngineCoreOutput:
    logprobs = None
    if before.new_logprobs is not None or after.new_logprobs is not None:
        logprobs = (before.new_logprobs or []) + (after.new_logprobs or [])
    return dataclasses.replace(
        after,
        new_token_ids=before.new_token_ids + after.new_token_ids,
        new_logprobs=logprobs,
        new_prompt_logprobs=before.new_prompt_logprobs,
    )
