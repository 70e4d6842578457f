"""AsyncLLM: the asyncio front end. One background engine task steps the engine core while
generate() iterators hand each request's outputs to its consumer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from asyncllm.config import EngineArgs
from asyncllm.engine.build import EngineParts, add_request, build_engine, process_outputs
from asyncllm.engine.input_processor import PromptType
from asyncllm.engine.output_processor import RequestOutputCollector
from asyncllm.outputs import RequestOutput
from asyncllm.request import RequestStatus
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed and cannot continue; every open request ends with this."""


class AsyncLLM:
    def __init__(self, engine: EngineParts) -> None:
        self.engine = engine
        self.collectors: dict[str, RequestOutputCollector] = {}
        self._pending_aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.dead_error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs | None = None, **kwargs: Any) -> AsyncLLM:
        return cls(build_engine(args or EngineArgs(**kwargs)))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; leaving the loop early aborts the request."""
        self._check_alive()
        if request_id in self.collectors:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        request, text = self.engine.input_processor.process(
            request_id, prompt, sampling_params, priority, add_special_tokens
        )
        collector = RequestOutputCollector(sampling_params.output_kind)
        self.collectors[request_id] = collector
        add_request(self.engine, request, text, collector)
        self._ensure_engine_task()
        self._wake.set()
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            self.collectors.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (all its parallel samples); its blocks are freed before the next step."""
        engine_ids = self.engine.output_processor.abort([request_id])
        self.collectors.pop(request_id, None)
        self._pending_aborts.update(engine_ids)
        self._wake.set()

    def check_health(self) -> None:
        self._check_alive()

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.engine.core.shutdown()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")

    def _ensure_engine_task(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run_engine())

    async def _run_engine(self) -> None:
        core = self.engine.core
        try:
            while True:
                self._apply_aborts()
                if not core.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                # with async scheduling, detokenizes step N while step N+1 computes
                process_outputs(self.engine, await core.step_async())
                await asyncio.sleep(0)  # let consumers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            logger.exception("engine loop died")
            self._fail_all(e)

    def _apply_aborts(self) -> None:
        if self._pending_aborts:
            ids, self._pending_aborts = list(self._pending_aborts), set()
            self.engine.core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def _fail_all(self, error: BaseException) -> None:
        self.dead_error = error
        dead = EngineDeadError(f"the engine has stopped: {error!r}")
        for collector in self.collectors.values():
            collector.put(dead)
