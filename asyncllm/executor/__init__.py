"""Executors run the model for the engine core (abstract.py: the interface)."""

from asyncllm.config import EngineConfig
from asyncllm.executor.abstract import Executor, WorkerDiedError
from asyncllm.executor.uniproc import UniprocExecutor

__all__ = ["Executor", "WorkerDiedError", "create_executor"]


def create_executor(config: EngineConfig) -> Executor:
    """Ray only when asked for (and imported only then); a process per rank for tensor
    parallelism; else the model in this process."""
    parallel = config.parallel
    if parallel.distributed_executor_backend == "ray":
        from asyncllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if parallel.tensor_parallel_size > 1:
        from asyncllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    return UniprocExecutor(config)
