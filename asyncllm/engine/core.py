"""EngineCore: scheduler + KV cache manager + model runner, one step at a time."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from asyncllm.config import EngineConfig
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.scheduler import Scheduler
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.request import Request, RequestStatus
from asyncllm.sample.logprobs import PromptLogprobs, TokenLogprobs
from asyncllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    new_prompt_logprobs: PromptLogprobs | None = None


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        self.kv_cache_manager = KVCacheManager(
            self.model_runner.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return self._skip_step(scheduler_output)
        try:
            runner_output = self.model_runner.execute_model(scheduler_output)
        except Exception as e:  # a failed step fails its requests, not the engine
            return self._fail_step(scheduler_output, e)
        return self._update(scheduler_output, runner_output)

    async def step_async(self) -> list[EngineCoreOutput]:
        """The same step, awaiting the runner's future so the event loop keeps running."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return self._skip_step(scheduler_output)
        try:
            runner_output = await asyncio.wrap_future(self.model_runner.execute(scheduler_output))
        except Exception as e:
            return self._fail_step(scheduler_output, e)
        return self._update(scheduler_output, runner_output)

    def shutdown(self) -> None:
        self.model_runner.shutdown()

    def _skip_step(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """Nothing to run, but the runner must still forget finished and preempted requests."""
        self.model_runner.forget(
            scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids
        )
        return []

    def _update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        finished = {
            r.request_id for r in self.scheduler.update_from_output(scheduler_output, runner_output)
        }
        outputs = []
        logprobs = runner_output.logprobs or [None] * len(scheduler_output.scheduled)
        steps = zip(scheduler_output.scheduled, runner_output.sampled_token_ids, logprobs)
        for s, token_id, token_logprobs in steps:
            request = s.request
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            if token_id is None and prompt_logprobs is None and request.request_id not in finished:
                continue
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[] if token_id is None else [token_id],
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    new_logprobs=None if token_logprobs is None else [token_logprobs],
                    new_prompt_logprobs=prompt_logprobs,
                )
            )
        return outputs

    def _fail_step(
        self, scheduler_output: SchedulerOutput, error: Exception
    ) -> list[EngineCoreOutput]:
        logger.exception(
            "engine step failed; failing its %d requests", len(scheduler_output.scheduled)
        )
        ids = [s.request.request_id for s in scheduler_output.scheduled]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        message = f"{type(error).__name__}: {error}"
        return [EngineCoreOutput(rid, [], "error", None, error=message) for rid in ids]
