"""AsyncLLM: the asyncio front end. One background engine task takes in the engine core's steps
(from its thread in this process, or from its own process) while generate() iterators hand
each request's outputs to its consumer.

A core that fails as a whole (its process died or raised, a worker died, a step outside any
request raised) makes the engine dead: every open request ends with EngineDeadError, new ones
are refused, and restart() puts a new core in its place.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from typing import Any

from asyncllm.config import EngineArgs
from asyncllm.engine.core_client import CoreClient
from asyncllm.engine.front_end import FrontEnd
from asyncllm.engine.input_processor import PromptType
from asyncllm.engine.messages import EngineStats
from asyncllm.engine.output_processor import (
    OutputProcessor,
    RequestOutputCollector,
    child_request_id,
)
from asyncllm.engine.prompt_tokenizer import PromptTokenizer
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed and cannot continue; every open request ends with this."""


class AsyncLLM(FrontEnd):
    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args, core_process_allowed=True)
        self.collectors: dict[str, RequestOutputCollector] = {}
        tokenizer = self.tokenizer
        self.prompt_tokenizer = PromptTokenizer(tokenizer) if tokenizer is not None else None
        self._task: asyncio.Task | None = None
        self.dead_error: BaseException | None = None
        self._dead = asyncio.Event()
        self._restarting: asyncio.Future | None = None
        # tokens scheduled in a step -> how many steps scheduled that many, for /metrics: at
        # most max_num_batched_tokens keys, however long the engine runs
        self.steps_by_num_tokens: collections.Counter[int] = collections.Counter()

    @classmethod
    def from_engine_args(cls, args: EngineArgs | None = None, **kwargs: Any) -> AsyncLLM:
        return cls(args or EngineArgs(**kwargs))

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
        logger.debug("request %s: received", request_id)
        try:
            prompt = await self._with_token_ids(prompt, add_special_tokens)
            self._check_alive()
            if self.collectors.get(request_id) is not collector:
                return  # aborted while its prompt was tokenized
            request, text = self.make_request(
                request_id, prompt, sampling_params, priority, add_special_tokens
            )
            self.add_request(request, text, collector)
            logger.debug(
                "request %s: %d prompt tokens, to the core",
                request_id,
                len(request.prompt_token_ids),
            )
        except BaseException:
            if self.collectors.get(request_id) is collector:
                del self.collectors[request_id]
            raise
        self.start()
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            self.collectors.pop(request_id, None)
            if not finished:
                logger.debug("request %s: aborted", request_id)
                self.abort(request_id)
            else:
                logger.debug("request %s: finished", request_id)

    async def _with_token_ids(self, prompt: PromptType, add_special_tokens: bool) -> PromptType:
        """A text prompt with its token ids, from the tokenizer's thread."""
        text = self.input_processor.prompt_text(prompt)
        if text is None:
            return prompt
        token_ids = await self.prompt_tokenizer.encode(text, add_special_tokens)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def abort(self, request_id: str) -> None:
        """Stop a request (all its parallel samples); its blocks are freed before the next step."""
        self.abort_request(request_id)
        self.collectors.pop(request_id, None)

    def start_profile(self) -> None:
        """The engine core's torch profiler on (--profiler-dir); stop_profile writes the trace."""
        self.core_client.profile(True)

    def stop_profile(self) -> None:
        self.core_client.profile(False)

    def stats(self) -> EngineStats:
        """As of the last step taken in."""
        return self.latest_stats

    def is_queued(self, request_id: str) -> bool:
        """Whether the engine holds this request (or its first sample) and has not scheduled it
        yet."""
        states = self.output_processor.states
        state = states.get(request_id) or states.get(child_request_id(0, request_id))
        return state is not None and state.first_scheduled_time is None

    def start(self) -> None:
        """Starts the engine task (generate() does too), which also watches the core: one that
        dies while idle is noticed at once."""
        if self._task is None and self.dead_error is None:
            self._task = asyncio.get_running_loop().create_task(self._run_engine())

    async def wait_until_dead(self) -> BaseException:
        """The error that killed the engine, once it has."""
        await self._dead.wait()
        return self.dead_error

    async def restart(self) -> None:
        """A new engine core in place of the dead one (the old one is stopped and reaped
        first, so that their memory never overlaps); serves again once it is up. Raises what
        the new core's start raised, the engine staying dead."""
        if self.dead_error is None:
            raise RuntimeError("restart() needs a dead engine.")
        await self._task
        loop = asyncio.get_running_loop()
        self._restarting = loop.run_in_executor(None, self._replace_core)
        await self._restarting  # if this is cancelled, shutdown() still waits for the new core
        self._restarting = None
        self._task = None
        self.dead_error = None
        self._dead.clear()
        self.start()

    def _replace_core(self) -> None:
        self.core_client.shutdown()
        self.core_client = CoreClient.create(self.config, self.config.engine_process)

    async def shutdown(self) -> None:
        if self._restarting is not None:
            await asyncio.gather(self._restarting, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.prompt_tokenizer is not None:
            self.prompt_tokenizer.shutdown()
        self.core_client.shutdown()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")

    async def _run_engine(self) -> None:
        try:
            while True:
                # with async scheduling, detokenizes step N while step N+1 computes
                step = await self.core_client.get_output_async()
                self.process_step(step)
                self.steps_by_num_tokens.update(step.num_scheduled_tokens)
                await asyncio.sleep(0)  # let consumers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            logger.exception("engine loop died")
            self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        """Ends every open request; nothing of theirs survives into a restarted core."""
        self.dead_error = error
        dead = EngineDeadError(f"the engine has stopped: {error!r}")
        for collector in self.collectors.values():
            collector.put(dead)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.latest_stats = EngineStats()
        self._dead.set()
