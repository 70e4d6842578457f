"""MultiprocExecutor: one worker process per tensor-parallel rank on this machine.

Each step's scheduler output is pickled once and sent down every worker's pipe; every rank
runs the same step (the collectives pair up), and rank 0's reply carries the sampled ids. A
collector thread waits on the replies and on the processes at once: a worker that raises or
exits fails the steps in flight with WorkerDiedError, and the others are killed at once rather
than left waiting in a collective. The workers are daemons of this process and read their pipe
to its end: if this process goes, they go too.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import multiprocessing
import pickle
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.distributed.parallel_state import DistributedInit, backend_for, destroy_distributed
from asyncllm.executor.abstract import Executor, WorkerDiedError
from asyncllm.executor.uniproc import UniprocExecutor
from asyncllm.executor.wire import StepWire
from asyncllm.worker.worker import init_worker

logger = logging.getLogger(__name__)

_STOP = b""
_JOIN_TIMEOUT_S = 5.0
_PEER_EXIT_GRACE_S = 0.2  # how long a failed rank's peers are watched for the death behind it


@dataclass(frozen=True)
class _Ready:
    num_blocks: int


@dataclass(frozen=True)
class _Failed:
    message: str


@dataclass(frozen=True)
class _StepDone:
    output: ModelRunnerOutput | None  # rank 0's; None from the other ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def run_worker(config: EngineConfig, init: DistributedInit, conn: Connection) -> None:
    """A worker process: one rank's model runner, stepping what comes down the pipe."""
    try:
        executor = UniprocExecutor(init_worker(config, init, init.rank))
    except BaseException as e:
        conn.send(_Failed(describe(e)))
        return
    conn.send(_Ready(executor.num_blocks))
    sending = threading.Lock()  # replies come from this thread and the runner's collector

    def reply(future: concurrent.futures.Future[ModelRunnerOutput]) -> None:
        try:
            output = future.result()
            message: _StepDone | _Failed = _StepDone(output if init.rank == 0 else None)
        except BaseException as e:
            message = _Failed(describe(e))
        with sending:
            conn.send(message)

    try:
        while (data := conn.recv_bytes()) != _STOP:
            executor.execute_model(pickle.loads(data)).add_done_callback(reply)
    except EOFError:
        pass  # the engine is gone
    finally:
        executor.shutdown()
        destroy_distributed()


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection

    def receive(self) -> _Ready | _Failed | _StepDone:
        """The next message, or _Failed once the process is gone."""
        ready = wait([self.conn, self.process.sentinel])
        if self.conn in ready:
            try:
                return self.conn.recv()
            except (EOFError, OSError):  # a killed peer's socket may also reset
                pass
        self.process.join(_JOIN_TIMEOUT_S)
        return _Failed(f"the process exited with code {self.process.exitcode}")


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        world_size = config.parallel.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        backend = backend_for(config.model.device)
        context = multiprocessing.get_context("spawn")  # no forked copy of torch's threads
        self._workers: list[_Worker] = []
        self._pending: collections.deque[concurrent.futures.Future[ModelRunnerOutput]] = (
            collections.deque()
        )
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._stopping = False
        self._on_failure: Callable[[str], None] | None = None
        self._collector: threading.Thread | None = None
        self._wire = StepWire()
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            init = DistributedInit(world_size, rank, init_method, backend)
            process = context.Process(
                target=run_worker, args=(config, init, theirs), name=f"asyncllm-tp{rank}"
            )
            process.daemon = True
            process.start()
            theirs.close()  # the worker's end: closed here, our recv sees EOF when it exits
            self._workers.append(_Worker(rank, process, ours))
        try:
            self.num_blocks = self._wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self._collector = threading.Thread(target=self._collect, name="tp-collect", daemon=True)
        self._collector.start()

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> concurrent.futures.Future[ModelRunnerOutput]:
        future: concurrent.futures.Future[ModelRunnerOutput] = concurrent.futures.Future()
        sent = self._wire.outgoing(scheduler_output)
        data = pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._failure is not None:
                raise WorkerDiedError(self._failure)
            self._pending.append(future)  # before sending: the reply may come at once
        try:
            for worker in self._workers:
                worker.conn.send_bytes(data)
        except OSError as e:
            # the collector fails the future with the worker's own reason
            raise WorkerDiedError(f"a tensor-parallel worker is gone: {describe(e)}") from e
        return future

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._on_failure = callback

    def shutdown(self) -> None:
        self._stopping = True
        for worker in self._workers:
            with contextlib.suppress(OSError):
                worker.conn.send_bytes(_STOP)
        self._stop_workers(_JOIN_TIMEOUT_S)
        if self._collector is not None:
            self._collector.join()
        self._fail_pending("the executor was shut down")
        for worker in self._workers:
            worker.conn.close()

    def _wait_until_ready(self) -> int:
        num_blocks = []
        for worker in self._workers:
            message = worker.receive()
            if isinstance(message, _Failed):
                raise RuntimeError(
                    f"tensor-parallel worker {worker.rank} failed to start: {message.message}"
                )
            num_blocks.append(message.num_blocks)
        return min(num_blocks)

    def _collect(self) -> None:
        """Pairs each step's replies (one per rank) with the oldest pending future."""
        while True:
            output: ModelRunnerOutput | None = None
            outstanding = {worker.conn: worker for worker in self._workers}
            while outstanding:
                sentinels = [w.process.sentinel for w in outstanding.values()]
                ready = wait([*outstanding, *sentinels])
                for worker in [
                    w for w in outstanding.values() if {w.conn, w.process.sentinel} & set(ready)
                ]:
                    del outstanding[worker.conn]
                    message = worker.receive()
                    if isinstance(message, _Failed):
                        self._fail(self._cause(worker, message))
                        return
                    if worker.rank == 0:
                        output = message.output
            with self._lock:
                future = self._pending.popleft()
            future.set_result(output)

    def _cause(self, failed: _Worker, message: _Failed) -> str:
        """The failure's reason; a rank whose collective broke because a peer died (a reset
        connection) may report first, so a peer that exits meanwhile is named as the cause."""
        reason = f"tensor-parallel worker {failed.rank}: {message.message}"
        if self._stopping:
            return reason
        peers = [w for w in self._workers if w is not failed]
        exited = wait([w.process.sentinel for w in peers], _PEER_EXIT_GRACE_S)
        for peer in peers:
            if peer.process.sentinel in exited:
                peer.process.join(_JOIN_TIMEOUT_S)
                died = f"the process exited with code {peer.process.exitcode}"
                return f"tensor-parallel worker {peer.rank}: {died} ({reason})"
        return reason

    def _fail(self, message: str) -> None:
        with self._lock:
            self._failure = message
        if self._stopping:  # the workers exit as asked; shutdown() reaps them
            self._fail_pending(message)
            return
        logger.error("%s; stopping the other workers", message)
        for worker in self._workers:
            worker.process.kill()  # at once, rather than left waiting in a collective
        # the steps and the engine fail before the workers are reaped: a killed process's
        # memory takes a while to free
        self._fail_pending(message)
        if self._on_failure is not None:
            self._on_failure(message)  # noticed while idle too: the collector always watches
        self._stop_workers(0.0)

    def _fail_pending(self, message: str) -> None:
        with self._lock:
            futures, self._failure = list(self._pending), self._failure or message
            self._pending.clear()
        for future in futures:
            future.set_exception(WorkerDiedError(message))

    def _stop_workers(self, timeout: float) -> None:
        for worker in self._workers:
            worker.process.join(timeout)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
