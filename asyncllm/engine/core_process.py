"""The engine core in its own process: it steps the model back to back while the server's event
loop streams, and the two exchange the messages of messages.py over pipes."""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from asyncllm.config import EngineArgs
from asyncllm.debugging import configure_logging, start_function_trace
from asyncllm.engine.core import EngineCore
from asyncllm.engine.heap import (
    freeze_startup_objects,
    release_freed_memory,
    use_one_malloc_arena,
)
from asyncllm.engine.messages import (
    CoreStep,
    EngineCoreRequest,
    Failed,
    FinishRequests,
    Profile,
    Ready,
    Shutdown,
)

logger = logging.getLogger(__name__)

# Failed: the executor's failure callback, from its own thread
Message = EngineCoreRequest | FinishRequests | Profile | Shutdown | Failed


def main() -> None:
    """Entry point of the core process: its pipes' file descriptors are its arguments."""
    use_one_malloc_arena()
    inbox_fd, outbox_fd = map(int, sys.argv[1:3])
    run_core_process(Connection(inbox_fd, writable=False), Connection(outbox_fd, readable=False))


def run_core_process(inbox: Connection, outbox: Connection) -> None:
    """The child process's work: the first message is its EngineArgs."""
    configure_logging()
    start_function_trace("engine_core")
    try:
        args: EngineArgs = inbox.recv()
        core = EngineCore(args.create_engine_config())
    except BaseException as e:
        outbox.send(Failed(f"{type(e).__name__}: {e}"))
        return
    freeze_startup_objects()
    messages = _receive_in_thread(inbox)
    core.watch_executor(messages.put)
    outbox.send(Ready(core.capacity))
    try:
        run_core_loop(core, messages, outbox.send)
    except BaseException as e:
        logger.exception("engine core process died")
        outbox.send(Failed(f"{type(e).__name__}: {e}"))
    finally:
        core.shutdown()


def run_core_loop(
    core: EngineCore, messages: queue.Queue[Message], emit: Callable[[CoreStep], None]
) -> None:
    """Applies the messages that came in, steps, and emits the step, until Shutdown; idles on
    the queue while the core has no work."""
    while True:
        if not core.has_work():
            if messages.empty():
                release_freed_memory()
            if not _apply(core, messages.get()):
                return
        while not messages.empty():
            if not _apply(core, messages.get_nowait()):
                return
        emit(core.step())


def _apply(core: EngineCore, message: Message) -> bool:
    """Applies a message; False for Shutdown. A failed executor (Failed) fails the core."""
    if isinstance(message, Shutdown):
        return False
    core.apply(message)
    return True


def _receive_in_thread(inbox: Connection) -> queue.Queue[Message]:
    """Messages from the front end, read by a thread so that they queue up while a step runs;
    a closed pipe (the front end is gone) reads as Shutdown."""
    messages: queue.Queue[Message] = queue.Queue()

    def receive() -> None:
        try:
            while True:
                messages.put(inbox.recv())
        except (EOFError, OSError):
            messages.put(Shutdown())

    threading.Thread(target=receive, name="core-inbox", daemon=True).start()
    return messages
