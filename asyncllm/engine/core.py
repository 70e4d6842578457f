"""EngineCore: the scheduler, the KV cache manager and an executor, one step at a time.

A step is launched (scheduled and handed to the executor, which returns a future) and later
finished (its output taken in by the scheduler). Steps in flight wait in a queue: at depth 1 a
step is finished before the next is scheduled; at depth 2 (async scheduling) step N+1 is
scheduled and launched while step N runs, its input tokens taken from N's on the device.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass

from asyncllm.config import EngineConfig
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.scheduler import Scheduler
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.debugging import log_scheduler, profiler_dir
from asyncllm.engine.gil import shorten_switch_interval
from asyncllm.engine.messages import (
    CoreStep,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    Failed,
    FinishRequests,
    KVCapacity,
    Profile,
)
from asyncllm.engine.profiler import CoreProfiler
from asyncllm.executor import Executor, WorkerDiedError, create_executor
from asyncllm.request import Request, RequestStatus
from asyncllm.spec_decode.metrics import SpecDecodingStats
from asyncllm.spec_decode.proposer import take_drafts

# how long an engine with nothing else to do waits for a grammar before looking at its inbox
_GRAMMAR_POLL_S = 0.05

logger = logging.getLogger(__name__)


@dataclass
class _LaunchedStep:
    scheduler_output: SchedulerOutput
    future: concurrent.futures.Future[ModelRunnerOutput]


@dataclass
class _CompilingRequest:
    request: Request
    prompt_computed_by: str | None
    grammar: concurrent.futures.Future


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        shorten_switch_interval(config.model.device)  # its threads hand the GIL over each step
        self.executor: Executor = create_executor(config)
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.depth = 2 if config.async_scheduling else 1
        self.spec_decoding_stats = SpecDecodingStats()
        self._in_flight: collections.deque[_LaunchedStep] = collections.deque()
        # finished and preempted ids of empty schedules, for the runner's next step
        self._unannounced = SchedulerOutput()
        self._first_scheduled: dict[str, float] = {}
        # request id -> parallel samples waiting for that request to compute their prompt
        self._waiting_for_prompt: dict[str, list[Request]] = {}
        self._log_steps = log_scheduler()
        folder = profiler_dir(config.args.profiler_dir)
        self.profiler = CoreProfiler(folder) if folder else None
        # made at the first constrained request (xgrammar is an optional dependency)
        self._grammar_compiler = None
        # requests held back until their structured-output grammar is compiled
        self._compiling: dict[str, _CompilingRequest] = {}
        self._grammar_failures: list[EngineCoreOutput] = []
        self._draft_checker = None  # made at the first constrained request's drafts

    @property
    def capacity(self) -> KVCapacity:
        return KVCapacity(self.kv_cache_manager.num_blocks, self.kv_cache_manager.block_size)

    def add_request(self, core_request: EngineCoreRequest) -> None:
        request = Request(
            request_id=core_request.request_id,
            prompt_token_ids=core_request.prompt_token_ids,
            sampling_params=core_request.sampling_params,
            eos_token_ids=core_request.eos_token_ids,
            max_tokens=core_request.max_tokens,
            priority=core_request.priority,
            bad_words_token_ids=core_request.bad_words_token_ids,
            arrival_time=core_request.arrival_time,
        )
        logger.debug("request %s: in the core", request.request_id)
        structured = core_request.sampling_params.structured_outputs
        source = core_request.prompt_computed_by
        if structured is not None:
            grammar = self.grammar_compiler.submit(structured)
            self._compiling[request.request_id] = _CompilingRequest(request, source, grammar)
        else:
            self._admit(request, source)

    def _admit(self, request: Request, source: str | None) -> None:
        if source is not None and not self._prompt_computed(source):
            self._waiting_for_prompt.setdefault(source, []).append(request)
        else:
            self.scheduler.add_request(request)

    def watch_executor(self, post: Callable[[Failed], None]) -> None:
        """Has the executor's failure, idle or not, posted (from its thread) as a Failed to
        the core's inbox: applying it fails the core as a whole."""
        self.executor.register_failure_callback(lambda reason: post(Failed(reason)))

    def apply(self, message: EngineCoreRequest | FinishRequests | Profile | Failed) -> None:
        if isinstance(message, Failed):
            raise WorkerDiedError(message.error)
        if isinstance(message, FinishRequests):
            self.finish_requests(message.request_ids, message.status)
        elif isinstance(message, Profile):
            self._profile(message.start)
        else:
            self.add_request(message)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        logger.debug("requests %s: %s from the front end", request_ids, status.name)
        ids = set(request_ids)
        for request_id in ids & self._compiling.keys():
            del self._compiling[request_id]
        for source, waiting in list(self._waiting_for_prompt.items()):
            kept = [r for r in waiting if r.request_id not in ids]
            if kept:
                self._waiting_for_prompt[source] = kept
            else:
                del self._waiting_for_prompt[source]
        self.scheduler.finish_requests(request_ids, status)
        self._release_waiting()

    def has_work(self) -> bool:
        """Unfinished requests, or a launched step whose output is not taken in yet."""
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._in_flight)
            or bool(self._waiting_for_prompt)
            or bool(self._compiling)
            or bool(self._grammar_failures)
        )

    def step(self) -> CoreStep:
        """Launches steps until `depth` are in flight (or nothing more can be scheduled), then
        finishes the oldest, blocking this thread until its output is on the host."""
        self._admit_compiled()
        self._launch_more()
        outputs, self._grammar_failures = self._grammar_failures, []
        num_tokens: list[int] = []
        if self._in_flight:
            finished = self._in_flight.popleft()
            outputs += self._finish(finished)
            num_tokens = [finished.scheduler_output.total_num_scheduled_tokens]
            # a speculating request whose drafts are checked or made on the host is not
            # scheduled ahead of its step in flight: launched here, its next step runs while
            # the front end takes these in
            if self.config.speculative is not None and self.depth > 1 and not self._in_flight:
                self._launch_more()
        elif self._compiling and not outputs:
            grammars = [c.grammar for c in self._compiling.values()]
            concurrent.futures.wait(grammars, _GRAMMAR_POLL_S, concurrent.futures.FIRST_COMPLETED)
        first_scheduled, self._first_scheduled = self._first_scheduled, {}
        return CoreStep(outputs, self.stats(), self.has_work(), first_scheduled, num_tokens)

    def _launch_more(self) -> None:
        while len(self._in_flight) < self.depth and (launched := self._launch()) is not None:
            self._in_flight.append(launched)

    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv_cache_manager
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            spec_decoding=self.spec_decoding_stats.snapshot() if self.config.speculative else None,
        )

    def shutdown(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        if self._grammar_compiler is not None:
            self._grammar_compiler.shutdown()
        self.executor.shutdown()

    def _profile(self, start: bool) -> None:
        if self.profiler is None:
            logger.warning("profiling is off: no --profiler-dir or ASYNCLLM_TORCH_PROFILER_DIR")
        elif start:
            self.profiler.start()
        else:
            self.profiler.stop()

    @property
    def grammar_compiler(self):
        """Compiles structured-output constraints against the model's vocabulary."""
        if self._grammar_compiler is None:
            from asyncllm.structured_output.compiler import GrammarCompiler, model_vocabulary

            self._grammar_compiler = GrammarCompiler(model_vocabulary(self.config.model))
        return self._grammar_compiler

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready go on to the scheduler; a failed compile fails its
        request."""
        for request_id, compiling in list(self._compiling.items()):
            if not compiling.grammar.done():
                continue
            del self._compiling[request_id]
            error = compiling.grammar.exception()
            if error is not None:
                message = f"structured_outputs: {type(error).__name__}: {error}"
                self._grammar_failures.append(
                    EngineCoreOutput(request_id, [], "error", None, error=message)
                )
                continue
            compiling.request.grammar = compiling.grammar.result()
            self._admit(compiling.request, compiling.prompt_computed_by)

    def _launch(self) -> _LaunchedStep | None:
        scheduler_output = self.scheduler.schedule()
        if self._log_steps and (scheduler_output.scheduled or scheduler_output.preempted_req_ids):
            logger.info("step: %s", self.scheduler.describe(scheduler_output))
        for request_id in scheduler_output.first_scheduled:
            logger.debug("request %s: scheduled", request_id)
        # the runner forgets finished and preempted requests when it runs the next step
        scheduler_output.finished_req_ids |= self._unannounced.finished_req_ids
        scheduler_output.preempted_req_ids |= self._unannounced.preempted_req_ids
        self._first_scheduled |= scheduler_output.first_scheduled
        if scheduler_output.is_empty:
            self._unannounced = scheduler_output
            return None
        self._unannounced = SchedulerOutput()
        return _LaunchedStep(scheduler_output, self.executor.execute_model(scheduler_output))

    def _finish(self, launched: _LaunchedStep) -> list[EngineCoreOutput]:
        """A failed step fails its requests, not the engine; a failed worker stops the engine."""
        try:
            result = launched.future.result()
        except WorkerDiedError:
            raise  # no step can run any more: the core fails as a whole
        except Exception as e:
            return self._fail_step(launched.scheduler_output, e)
        outputs = self._update(launched.scheduler_output, result)
        self._release_waiting()
        return outputs

    def _prompt_computed(self, request_id: str) -> bool:
        if request_id in self._compiling:  # its grammar compiles: not scheduled yet
            return False
        request = self.scheduler.get_request(request_id)
        return request is None or request.num_computed_tokens >= request.num_prompt_tokens

    def _release_waiting(self) -> None:
        for source in list(self._waiting_for_prompt):
            if self._prompt_computed(source):
                for request in self._waiting_for_prompt.pop(source):
                    self.scheduler.add_request(request)

    def _update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        if runner_output.verified is not None:
            self.spec_decoding_stats.observe(runner_output.verified)
        finished = {
            r.request_id for r in self.scheduler.update_from_output(scheduler_output, runner_output)
        }
        for request_id in finished:
            logger.debug("request %s: finished in the core", request_id)
        outputs = []
        for row, s in enumerate(scheduler_output.scheduled):
            request = s.request
            if request.status is not RequestStatus.RUNNING and request.request_id not in finished:
                continue  # preempted, aborted or failed while the step ran: its token is dropped
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            token_ids = runner_output.tokens_of(row)
            if not token_ids and prompt_logprobs is None and request.request_id not in finished:
                continue
            logprobs = runner_output.logprobs_of(row)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=token_ids,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    new_logprobs=None if logprobs is None else logprobs[: len(token_ids)],
                    new_prompt_logprobs=prompt_logprobs,
                )
            )
        if runner_output.draft_token_ids is not None:
            requests = (s.request for s in scheduler_output.scheduled)
            take_drafts(requests, runner_output.draft_token_ids, self._grammar_drafts)
        return outputs

    def _grammar_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """A constrained request's drafts are cut to the prefix its grammar takes here, as
        they are proposed and before the scheduler sees them: past a forbidden draft the
        verify rows have no grammar state to be masked with, and the drafts there could only
        be rejected, yet would take KV slots, verify rows and the drafts' counts."""
        if request.grammar is None or not drafts:
            return drafts
        if self._draft_checker is None:
            from asyncllm.structured_output.draft_check import DraftChecker

            self._draft_checker = DraftChecker()
        return self._draft_checker.valid_prefix(request, drafts)

    def _fail_step(
        self, scheduler_output: SchedulerOutput, error: Exception
    ) -> list[EngineCoreOutput]:
        logger.error(
            "engine step failed; failing its %d requests",
            len(scheduler_output.scheduled),
            exc_info=error,
        )
        ids = [s.request.request_id for s in scheduler_output.scheduled]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        ids += self._drop_samples_of(set(ids))
        message = f"{type(error).__name__}: {error}"
        return [EngineCoreOutput(rid, [], "error", None, error=message) for rid in ids]

    def _drop_samples_of(self, request_ids: set[str]) -> list[str]:
        """The parallel samples that wait (or compile their grammar) for a failed request's
        prompt, taken off: they fail with it (their parent has failed). Left waiting for a
        prompt no step computes, they kept the engine busy forever."""
        dropped = [r.request_id for i in request_ids for r in self._waiting_for_prompt.pop(i, [])]
        for request_id, compiling in list(self._compiling.items()):
            if compiling.prompt_computed_by in request_ids:
                del self._compiling[request_id]
                dropped.append(request_id)
        return dropped
