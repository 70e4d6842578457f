"""AsyncLLM: the asyncio front end. One background engine task takes in the engine core's steps
(stepping it, or receiving them from its process) while generate() iterators hand each
request's outputs to its consumer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from asyncllm.config import EngineArgs
from asyncllm.engine.build import EngineParts, add_request, build_engine, process_outputs
from asyncllm.engine.core_client import CoreClient, CoreProcessClient, LocalCoreClient
from asyncllm.engine.core_process import EngineStats
from asyncllm.engine.input_processor import PromptType
from asyncllm.engine.output_processor import RequestOutputCollector, child_request_id
from asyncllm.engine.prompt_tokenizer import PromptTokenizer
from asyncllm.outputs import RequestOutput
from asyncllm.request import RequestStatus
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed and cannot continue; every open request ends with this."""


class AsyncLLM:
    def __init__(self, engine: EngineParts) -> None:
        self.engine = engine
        self.config = engine.config
        self.input_processor = engine.input_processor
        core = engine.core
        self.client: CoreClient = (
            core if isinstance(core, CoreProcessClient) else LocalCoreClient(core)
        )
        self.collectors: dict[str, RequestOutputCollector] = {}
        tokenizer = engine.tokenizer
        self.prompt_tokenizer = PromptTokenizer(tokenizer) if tokenizer is not None else None
        self._task: asyncio.Task | None = None
        self.dead_error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs | None = None, **kwargs: Any) -> AsyncLLM:
        return cls(build_engine(args or EngineArgs(**kwargs), core_process_allowed=True))

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
        collector = RequestOutputCollector(sampling_params.output_kind)
        self.collectors[request_id] = collector  # holds the id while the prompt is tokenized
        try:
            prompt = await self._with_token_ids(prompt, add_special_tokens)
            self._check_alive()
            if self.collectors.get(request_id) is not collector:
                return  # aborted while its prompt was tokenized
            request, text = self.engine.input_processor.process(
                request_id, prompt, sampling_params, priority, add_special_tokens
            )
            add_request(self.engine, request, text, collector, self.client)
        except BaseException:
            if self.collectors.get(request_id) is collector:
                del self.collectors[request_id]
            raise
        self._ensure_engine_task()
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

    async def _with_token_ids(self, prompt: PromptType, add_special_tokens: bool) -> PromptType:
        """A text prompt with its token ids, from the tokenizer's thread."""
        text = self.engine.input_processor.prompt_text(prompt)
        if text is None:
            return prompt
        token_ids = await self.prompt_tokenizer.encode(text, add_special_tokens)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def abort(self, request_id: str) -> None:
        """Stop a request (all its parallel samples); its blocks are freed before the next step."""
        engine_ids = self.engine.output_processor.abort([request_id])
        self.collectors.pop(request_id, None)
        self.client.finish_requests(engine_ids, RequestStatus.FINISHED_ABORTED)

    def check_health(self) -> None:
        self._check_alive()

    def stats(self) -> EngineStats:
        return self.client.stats()

    def is_queued(self, request_id: str) -> bool:
        """Whether the engine holds this request (or its first sample) and has not scheduled it
        yet."""
        states = self.engine.output_processor.states
        state = states.get(request_id) or states.get(child_request_id(0, request_id))
        request = state.request if state is not None else None
        return request is not None and request.first_scheduled_time is None

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.prompt_tokenizer is not None:
            self.prompt_tokenizer.shutdown()
        self.client.shutdown()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")

    def _ensure_engine_task(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run_engine())

    async def _run_engine(self) -> None:
        try:
            while True:
                # with async scheduling, detokenizes step N while step N+1 computes
                step = await self.client.get_step()
                self._note_first_scheduled(step.first_scheduled)
                process_outputs(self.engine, step.outputs)
                await asyncio.sleep(0)  # let consumers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            logger.exception("engine loop died")
            self._fail_all(e)

    def _note_first_scheduled(self, times: dict[str, float]) -> None:
        """The core process reports when it first scheduled each request (queue-time metrics,
        --max-queue-wait); in one process the scheduler sets it on the shared request."""
        for request_id, when in times.items():
            state = self.engine.output_processor.states.get(request_id)
            if state is not None and state.request is not None:
                state.request.first_scheduled_time = when

    def _fail_all(self, error: BaseException) -> None:
        self.dead_error = error
        dead = EngineDeadError(f"the engine has stopped: {error!r}")
        for collector in self.collectors.values():
            collector.put(dead)
