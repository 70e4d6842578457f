"""How the front end (LLM, AsyncLLM) reaches the engine core: in this process (InprocClient) or
in a process of its own (CoreProcessClient, AsyncLLM's default on CUDA), where stepping the model
never waits for the event loop that streams the outputs. Both take EngineCoreRequests and
FinishRequests and hand back one CoreStep per engine step; nothing else crosses."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import threading
from abc import ABC, abstractmethod

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.engine.core import EngineCore
from asyncllm.engine.heap import release_freed_memory
from asyncllm.engine.messages import (
    CoreStep,
    EngineCoreOutput,
    EngineCoreRequest,
    Failed,
    FinishRequests,
    KVCapacity,
    Profile,
    Ready,
    Shutdown,
)
from asyncllm.request import RequestStatus


class CoreClient(ABC):
    capacity: KVCapacity

    @staticmethod
    def create(config: EngineConfig, own_process: bool) -> CoreClient:
        return CoreProcessClient(config) if own_process else InprocClient(EngineCore(config))

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None: ...

    @abstractmethod
    def profile(self, start: bool) -> None:
        """Starts or stops the core's torch profiler (--profiler-dir)."""

    @abstractmethod
    def get_output(self) -> CoreStep:
        """The next step's outputs, blocking this thread."""

    @abstractmethod
    async def get_output_async(self) -> CoreStep:
        """The next step's outputs; waits while the engine has no work."""

    @abstractmethod
    def shutdown(self) -> None: ...


InboxMessage = EngineCoreRequest | FinishRequests | Profile | Failed


class InprocClient(CoreClient):
    """The core in this process. Requests and finishes wait in an inbox until the next step
    begins: AsyncLLM runs each step in a thread of its own while the event loop adds and aborts,
    so only that thread touches the core."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.capacity = core.capacity
        self._inbox: collections.deque[InboxMessage] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stepper: concurrent.futures.ThreadPoolExecutor | None = None
        core.watch_executor(self._post_from_thread)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._post(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        if request_ids:
            self._post(FinishRequests(list(request_ids), status))

    def profile(self, start: bool) -> None:
        self._post(Profile(start))

    def get_output(self) -> CoreStep:
        while self._inbox:
            self.core.apply(self._inbox.popleft())
        return self.core.step()

    async def get_output_async(self) -> CoreStep:
        if self._wake is None:
            self._wake = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._stepper = concurrent.futures.ThreadPoolExecutor(1, "engine-core")
        while not (self._inbox or self.core.has_work()):
            self._wake.clear()
            release_freed_memory()
            await self._wake.wait()
        return await asyncio.get_running_loop().run_in_executor(self._stepper, self.get_output)

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.shutdown(wait=True)
        self.core.shutdown()

    def _post(self, message: InboxMessage) -> None:
        self._inbox.append(message)
        if self._wake is not None:
            self._wake.set()

    def _post_from_thread(self, message: Failed) -> None:
        """The executor's failure, from its thread: it wakes an idle engine loop at once."""
        self._inbox.append(message)
        loop = self._loop  # read after the append: a loop that starts meanwhile sees it
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits
                loop.call_soon_threadsafe(self._wake.set)


class EngineCoreGone(RuntimeError):
    """The engine core process failed or exited."""


_CORE_MAIN = "from asyncllm.engine.core_process import main; main()"


class CoreProcessClient(CoreClient):
    """Starts the engine core in a fresh interpreter (core_process.main; unlike multiprocessing's
    spawn, it does not run the caller's main script again) and talks to it over two pipes.
    Outputs are read either by the caller (get_output) or, once get_output_async is used, by a
    reader thread that hands them to the event loop."""

    def __init__(self, config: EngineConfig) -> None:
        inbox_reader, self._inbox = multiprocessing.Pipe(duplex=False)
        self._outbox, outbox_writer = multiprocessing.Pipe(duplex=False)
        fds = (inbox_reader.fileno(), outbox_writer.fileno())
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CORE_MAIN, *map(str, fds)], pass_fds=fds
        )
        inbox_reader.close()
        outbox_writer.close()
        # readable once the process has exited, even if a child of its own still holds the
        # outbox open (a pipe alone would then never read EOF)
        self._exited = os.pidfd_open(self.process.pid)
        self._reader: threading.Thread | None = None
        self._send(config.args)
        self.capacity = self._wait_until_ready()
        self._steps: asyncio.Queue[CoreStep | Failed] | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        if not request_ids:
            return
        with contextlib.suppress(OSError):  # a core that is gone holds nothing to free
            self._inbox.send(FinishRequests(list(request_ids), status))

    def profile(self, start: bool) -> None:
        self._send(Profile(start))

    def get_output(self) -> CoreStep:
        messages = [self._receive()]
        while not isinstance(messages[-1], Failed) and self._outbox.poll():
            messages.append(self._receive())
        return _as_one_step(messages)

    async def get_output_async(self) -> CoreStep:
        """The next step, or all the steps that queued up meanwhile, joined."""
        if self._steps is None:
            self._steps = asyncio.Queue()
            self._start_reader(asyncio.get_running_loop(), self._steps)
        messages = [await self._steps.get()]
        while not self._steps.empty():
            messages.append(self._steps.get_nowait())
        return _as_one_step(messages)

    def shutdown(self) -> None:
        """Stops the process (killed if it does not exit in 30 s) and reaps it; its pipes and
        the reader thread end with it. Safe to call again, and on a process that died."""
        with contextlib.suppress(OSError):  # already gone
            self._inbox.send(Shutdown())
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._inbox.close()
        self._outbox.close()
        if self._exited >= 0:
            os.close(self._exited)
            self._exited = -1

    def _wait_until_ready(self) -> KVCapacity:
        message = self._receive()
        if isinstance(message, Failed):
            self.process.wait()
            raise EngineCoreGone(f"the engine core did not start: {message.error}")
        assert isinstance(message, Ready)
        return message.capacity

    def _send(self, message: EngineArgs | EngineCoreRequest | Profile) -> None:
        try:
            self._inbox.send(message)
        except OSError as e:
            raise EngineCoreGone(f"the engine core process is gone: {e!r}") from e

    def _start_reader(
        self, loop: asyncio.AbstractEventLoop, steps: asyncio.Queue[CoreStep | Failed]
    ) -> None:
        """The watcher too: a process that dies, idle or not, is a Failed here at once."""

        def read() -> None:
            while True:
                message = self._receive()
                try:
                    loop.call_soon_threadsafe(steps.put_nowait, message)
                except RuntimeError:
                    return  # the event loop is closed
                if isinstance(message, Failed):
                    return

        self._reader = threading.Thread(target=read, name="core-outbox", daemon=True)
        self._reader.start()

    def _receive(self) -> CoreStep | Ready | Failed:
        """The next message; Failed once the process has exited and left nothing unread."""
        try:
            multiprocessing.connection.wait([self._outbox, self._exited])
            if self._outbox.poll():
                return self._outbox.recv()
        except (EOFError, OSError):
            pass
        return Failed(f"the process exited with code {self.process.wait()}")


def _as_one_step(messages: list[CoreStep | Failed]) -> CoreStep:
    for message in messages:
        if isinstance(message, Failed):
            raise EngineCoreGone(f"the engine core process failed: {message.error}")
    return messages[0] if len(messages) == 1 else join_steps(messages)


def join_steps(steps: list[CoreStep]) -> CoreStep:
    """Steps that queued up while the front end was busy, as one: a request's tokens of
    consecutive steps become one output (one detokenizer update, one stream chunk), so a busy
    front end catches up instead of falling further behind. An output with prompt logprobs
    is not joined to the one before it."""
    outputs: list[EngineCoreOutput] = []
    latest: dict[str, int] = {}  # request id -> index of its last output in outputs
    first_scheduled: dict[str, float] = {}
    num_scheduled_tokens: list[int] = []
    for step in steps:
        first_scheduled |= step.first_scheduled
        num_scheduled_tokens += step.num_scheduled_tokens
        for out in step.outputs:
            i = latest.get(out.request_id)
            if i is not None and out.new_prompt_logprobs is None:
                outputs[i] = _joined(outputs[i], out)
            else:
                latest[out.request_id] = len(outputs)
                outputs.append(out)
    last = steps[-1]
    return CoreStep(outputs, last.stats, last.has_work, first_scheduled, num_scheduled_tokens)


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
