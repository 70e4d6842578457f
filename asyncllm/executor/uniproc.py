"""One worker in the caller's process: the model runner, launched from the caller's thread."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.executor.abstract import Executor
from asyncllm.worker.model_runner import ModelRunner


def _complete(future: concurrent.futures.Future, produce: Callable[[], object]) -> None:
    try:
        future.set_result(produce())
    except BaseException as e:
        future.set_exception(e)


class UniprocExecutor(Executor):
    """The step is launched in the caller's thread (launching returns once the GPU has it queued;
    on CPU the step has run by then). On a GPU a collector thread waits for the step's event
    and completes the future, so the caller may launch the next step meanwhile; for a step with
    grammars it first enqueues the step's sampling, once their masks are filled."""

    def __init__(self, config: EngineConfig) -> None:
        self.model_runner = ModelRunner(config)
        self.num_blocks = self.model_runner.num_blocks
        self._collector = concurrent.futures.ThreadPoolExecutor(1, "model-runner-collect")

    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> concurrent.futures.Future[ModelRunnerOutput]:
        result: concurrent.futures.Future[ModelRunnerOutput] = concurrent.futures.Future()
        try:
            launched = self.model_runner.execute_model(scheduler_output)
        except Exception as e:
            result.set_exception(e)
            return result
        if launched.on_host:
            _complete(result, launched.wait)
        else:
            self._collector.submit(_complete, result, launched.wait)
        return result

    def shutdown(self) -> None:
        self._collector.shutdown(wait=True, cancel_futures=True)
