"""The engine core in its own process: it steps the model back to back while the server's
event loop streams, and the two exchange plain messages over pipes.

In: AddRequest and FinishRequests, applied between steps, and Shutdown. Out: Ready once the
model is loaded (or Failed), then one CoreStep per step with that step's outputs.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from asyncllm.config import EngineArgs
from asyncllm.engine.core import EngineCore, EngineCoreOutput
from asyncllm.engine.heap import freeze_startup_objects, release_freed_memory
from asyncllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """What /metrics reports about the scheduler and the KV cache."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @classmethod
    def of(cls, core: EngineCore) -> EngineStats:
        scheduler, kv = core.scheduler, core.kv_cache_manager
        return cls(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )


@dataclass
class AddRequest:
    request: Request


@dataclass
class FinishRequests:
    request_ids: list[str]
    status: RequestStatus


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    # the KV cache's size, for the front end to refuse requests that could never fit
    num_blocks: int
    block_size: int


@dataclass
class Failed:
    error: str


@dataclass
class CoreStep:
    outputs: list[EngineCoreOutput]
    stats: EngineStats | None = None
    # request id -> time.monotonic() of its first scheduling, for requests first scheduled
    # since the last CoreStep (the front end's copy of the request never sees the scheduler)
    first_scheduled: dict[str, float] = field(default_factory=dict)


def main() -> None:
    """Entry point of the core process: its pipes' file descriptors are its arguments."""
    inbox_fd, outbox_fd = map(int, sys.argv[1:3])
    run_core_process(Connection(inbox_fd, writable=False), Connection(outbox_fd, readable=False))


def run_core_process(inbox: Connection, outbox: Connection) -> None:
    """The child process's work: the first message is its EngineArgs."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        args: EngineArgs = inbox.recv()
        core = EngineCore(args.create_engine_config())
    except BaseException as e:
        outbox.send(Failed(f"{type(e).__name__}: {e}"))
        return
    freeze_startup_objects()
    manager = core.kv_cache_manager
    outbox.send(Ready(manager.num_blocks, manager.block_size))
    try:
        CoreLoop(core, outbox).run(_receive_in_thread(inbox))
    except BaseException as e:
        logger.exception("engine core process died")
        outbox.send(Failed(f"{type(e).__name__}: {e}"))
    finally:
        core.shutdown()


def _receive_in_thread(inbox: Connection) -> queue.Queue:
    """Messages from the front end, read by a thread so that they queue up while a step runs;
    a closed pipe (the front end is gone) reads as Shutdown."""
    messages: queue.Queue = queue.Queue()

    def receive() -> None:
        try:
            while True:
                messages.put(inbox.recv())
        except (EOFError, OSError):
            messages.put(Shutdown())

    threading.Thread(target=receive, name="core-inbox", daemon=True).start()
    return messages


class CoreLoop:
    def __init__(self, core: EngineCore, outbox: Connection) -> None:
        self.core = core
        self.outbox = outbox
        self._unscheduled: dict[str, Request] = {}  # added, not yet scheduled

    def run(self, messages: queue.Queue) -> None:
        while True:
            if not self.core.has_work():
                if messages.empty():
                    release_freed_memory()
                if not self._apply(messages.get()):
                    return  # idle until a message comes
            while not messages.empty():
                if not self._apply(messages.get_nowait()):
                    return
            outputs = self.core.step() if self.core.has_work() else []
            self.outbox.send(CoreStep(outputs, EngineStats.of(self.core), self._first_scheduled()))

    def _apply(self, message: AddRequest | FinishRequests | Shutdown) -> bool:
        """Applies a message; False for Shutdown."""
        if isinstance(message, AddRequest):
            self.core.add_request(message.request)
            self._unscheduled[message.request.request_id] = message.request
        elif isinstance(message, FinishRequests):
            self.core.finish_requests(message.request_ids, message.status)
        return not isinstance(message, Shutdown)

    def _first_scheduled(self) -> dict[str, float]:
        times = {}
        for request_id, request in list(self._unscheduled.items()):
            if request.first_scheduled_time is not None or request.is_finished:
                del self._unscheduled[request_id]
            if request.first_scheduled_time is not None:
                times[request_id] = request.first_scheduled_time
        return times
