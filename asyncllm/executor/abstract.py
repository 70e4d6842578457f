"""The seam between the engine core and the workers that run the model.

The core hands each scheduled step to `execute_model` and gets a future of its output back at
once, so it can schedule the next step while this one runs. One worker in this process is the
UniprocExecutor; a worker per rank (tensor parallelism) plugs in behind the same two methods.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Callable

from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker died or failed mid-step: its peers may wait in a collective that never ends,
    so the executor runs no further step. A step's future fails with it; the engine core then
    fails as a whole, as if its own process had died, and the front end ends every request and
    starts a new core."""


class Executor(ABC):
    # the KV cache's size in blocks, the same on every worker
    num_blocks: int

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> concurrent.futures.Future[ModelRunnerOutput]:
        """Starts the step; the future completes once its sampled ids are on the host, or with
        the exception that failed it."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:  # noqa: B027
        """Has `callback(reason)` called, from any thread, once the executor can run no more
        steps, so that a worker dying while the core idles is noticed too. An executor
        without worker processes never fails that way."""
