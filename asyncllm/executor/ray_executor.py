"""RayExecutor: the tensor-parallel ranks as Ray actors, one per bundle of a placement group,
on the machines of a Ray cluster (`ray start --head` on one, `ray start --address` on the
others). Each actor is a rank as a worker process is one (worker.init_worker, then the model
runner); the step's scheduler output is put in Ray's object store once and read by every actor.

An actor that dies or raises fails the steps in flight with WorkerDiedError and the others are
killed. A watcher thread holds one call on each actor that never returns (`alive`): Ray fails
it once the actor dies, so a death while the engine idles is noticed too and reported to the
failure callback. Shutdown kills the actors and removes the placement group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.distributed.parallel_state import DistributedInit, backend_for
from asyncllm.executor.abstract import Executor, WorkerDiedError
from asyncllm.executor.multiproc import describe, free_port
from asyncllm.executor.uniproc import UniprocExecutor
from asyncllm.executor.wire import StepWire
from asyncllm.worker.worker import init_worker

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 60.0
_WATCH_POLL_S = 0.1  # how often the watcher looks whether the executor is shutting down


@ray.remote
class RayWorker:
    """One rank. Its methods are coroutines, so step N+1 is launched while step N runs."""

    def __init__(self) -> None:
        self.rank = -1
        self.executor: UniprocExecutor | None = None

    def rendezvous_address(self) -> str:
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def start(self, config: EngineConfig, init: DistributedInit) -> int:
        self.rank = init.rank
        # Ray shows each actor only its own GPU, as cuda:0
        self.executor = UniprocExecutor(init_worker(config, init, 0))
        return self.executor.num_blocks

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = await asyncio.wrap_future(self.executor.execute_model(scheduler_output))
        return output if self.rank == 0 else None

    async def alive(self) -> None:
        """Never returns: its reference fails once the actor dies (the executor's watch)."""
        await asyncio.Event().wait()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # joins the cluster `ray start` began on this machine, else starts one here
            ray.init()
        world_size = config.parallel.tensor_parallel_size
        on_gpu = config.model.device.type == "cuda"
        bundle = {"CPU": 1, "GPU": 1} if on_gpu else {"CPU": 1}
        self._group = placement_group([bundle] * world_size, strategy="PACK")
        self.workers: list = []
        self._failure: str | None = None
        self._stopping = threading.Event()
        self._on_failure: Callable[[str], None] | None = None
        self._watcher: threading.Thread | None = None
        self._wire = StepWire()
        self._collector = concurrent.futures.ThreadPoolExecutor(1, "ray-collect")
        try:
            self._place(world_size, bundle)
            init_method = ray.get(self.workers[0].rendezvous_address.remote())
            backend = backend_for(config.model.device)
            starts = [
                worker.start.remote(config, DistributedInit(world_size, rank, init_method, backend))
                for rank, worker in enumerate(self.workers)
            ]
            self.num_blocks = min(ray.get(starts))
        except BaseException:
            self.shutdown()
            raise
        liveness = [worker.alive.remote() for worker in self.workers]
        self._watcher = threading.Thread(
            target=self._watch, args=(liveness,), name="ray-watch", daemon=True
        )
        self._watcher.start()

    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> concurrent.futures.Future[ModelRunnerOutput]:
        if self._failure is not None:
            raise WorkerDiedError(self._failure)
        shared = ray.put(self._wire.outgoing(scheduler_output))
        replies = [worker.execute_model.remote(shared) for worker in self.workers]
        return self._collector.submit(self._gather, replies)

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._on_failure = callback

    def shutdown(self) -> None:
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()  # before ray.shutdown: it calls into Ray
        self._kill_workers()
        self._collector.shutdown(wait=True, cancel_futures=True)
        remove_placement_group(self._group)
        if self._owns_ray:
            ray.shutdown()

    def _place(self, world_size: int, bundle: dict[str, int]) -> None:
        try:
            ray.get(self._group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(
                f"the Ray cluster cannot place {world_size} workers of {bundle} "
                f"within {_PLACEMENT_TIMEOUT_S:.0f} s: {ray.cluster_resources()} in all"
            ) from e
        self.workers = [
            RayWorker.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(world_size)
        ]

    def _gather(self, replies: list[ray.ObjectRef]) -> ModelRunnerOutput:
        try:
            return ray.get(replies)[0]
        except Exception as e:
            self._failure = self._failure or f"a tensor-parallel Ray worker failed: {describe(e)}"
            self._kill_workers()
            raise WorkerDiedError(self._failure) from e

    def _watch(self, liveness: list[ray.ObjectRef]) -> None:
        """Waits for any actor's `alive` call to end (its death) until shutdown begins."""
        while not self._stopping.is_set():
            ended, _ = ray.wait(liveness, num_returns=1, timeout=_WATCH_POLL_S)
            if ended:
                rank = liveness.index(ended[0])
                self._fail(f"tensor-parallel Ray worker {rank}: {self._death_of(ended[0])}")
                return

    @staticmethod
    def _death_of(liveness: ray.ObjectRef) -> str:
        try:
            ray.get(liveness)
        except Exception as e:
            return describe(e)
        return "its liveness call returned"

    def _fail(self, message: str) -> None:
        logger.error("%s; stopping the other workers", message)
        self._failure = self._failure or message
        self._kill_workers()
        if self._on_failure is not None:
            self._on_failure(self._failure)

    def _kill_workers(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
