"""Runs one scheduled step: flat batch -> model -> sampled ids.

`execute_model()` prepares the step and enqueues it on the runner's own CUDA stream (inputs
copied from pinned buffers without blocking, steps replaying CUDA graphs, sampled ids copied back
without blocking) and returns before it has run, so the caller can launch step N+1 while step N
still runs, its input tokens taken from the ids N samples on the device (async scheduling). The
launched step's wait() blocks until the ids are on the host. On CPU the step runs to its end
inside execute_model. A step with grammars is enqueued up to its logits: its wait() (on the
executor's collector thread, after the step before's) enqueues the masking and sampling once the
grammars' masks are filled, while the caller's thread takes in the step before and schedules the
next; the next launch waits until that sampling is enqueued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.distributed.communication_op import tensor_model_parallel_min
from asyncllm.layers.linear import warm_up_packed_linears
from asyncllm.models.causal_lm import CausalLM
from asyncllm.models.loader import load_model
from asyncllm.outputs import PromptLogprobsChunk
from asyncllm.sample.grammar_mask import apply_token_bitmask
from asyncllm.sample.history import to_device
from asyncllm.sample.logprobs import (
    LogprobsTensors,
    PromptSpan,
    compute_prompt_logprobs,
    prompt_span,
)
from asyncllm.sample.metadata import SamplingMetadata
from asyncllm.sample.sampler import Sampler, SamplerOutput
from asyncllm.sample.state import SamplingState
from asyncllm.spec_decode.draft_step import DraftBatch, DraftLimits, TargetForward, target_step
from asyncllm.spec_decode.verify import (
    DraftLayout,
    DraftVerification,
    counts_moved_on,
    verify_drafts,
)
from asyncllm.spec_decode.worker_proposers import load_worker_proposer
from asyncllm.worker.cuda_graph import DecodeGraphs, GraphRunner, PiecewiseGraphs, ShortStepGraphs
from asyncllm.worker.input_batch import DeviceTokens, InputBatch, StepInputs
from asyncllm.worker.step_plan import StepPlan, StepPlanner, StepRunner

logger = logging.getLogger(__name__)
# the most the CPU KV cache takes unless --kv-cache-memory says otherwise, but never less than
# one whole sequence: for SmolLM2-135M (46 KiB a token in fp32) that is its 8,192 tokens, 368 MiB
_CPU_KV_CACHE_BYTES = 256 << 20
_GPU_ACTIVATION_RESERVE_BYTES = 4 << 30
# captured in this order, each kind only at the sizes its plans list
_GRAPH_KINDS = {
    StepRunner.DECODE_GRAPH: DecodeGraphs,
    StepRunner.SHORT_STEP_GRAPH: ShortStepGraphs,
    StepRunner.VERIFY_GRAPH: ShortStepGraphs,  # at the uniform verify steps' sizes
    StepRunner.PIECEWISE_GRAPHS: PiecewiseGraphs,
}


def _stream_context(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def make_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from asyncllm.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from asyncllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be torch, triton or auto; got {name!r}.")


def start_kernel_build(backend: AttentionBackend, device: torch.device) -> threading.Thread | None:
    """The CPU decode kernel's and layer ops' builds in a thread beside the model's load (the
    compiler and ninja run on another core): the first request waited for it, 15 s on a fresh
    install. Joined before the first forward, which would otherwise load the ops a second time."""
    from asyncllm.attention.torch_backend import TorchAttentionBackend

    if device.type != "cpu" or not isinstance(backend, TorchAttentionBackend):
        return None
    thread = threading.Thread(target=backend.build_cpu_kernels, name="kernel-build", daemon=True)
    thread.start()
    return thread


@dataclass
class LaunchedModelStep:
    """A step enqueued on the device; wait() turns it into the ModelRunnerOutput."""

    num_scheduled: int
    sampling_rows: list[int]
    sampled: SamplerOutput | None  # host tensors, filled once `done` has happened
    meta: SamplingMetadata | None
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    done: torch.cuda.Event | None  # None on CPU, where the step ran to its end already
    verification: DraftVerification | None = None  # a step that verified drafts, in host memory
    draft_token_ids: list[list[int]] | None = None  # the draft model's, per scheduled request
    device_drafts: torch.Tensor | None = None  # [R, k] host copy of drafts made on the device

    def wait(self) -> ModelRunnerOutput:
        """Blocks this thread (Event.synchronize releases the GIL) until the ids are here."""
        if self.done is not None:
            self.done.synchronize()
        output = ModelRunnerOutput(sampled_token_ids=[None] * self.num_scheduled)
        if self.verification is not None:
            *firsts, output.verified = self.verification.results(
                self.sampling_rows, self.num_scheduled
            )
            output.set_sampled(self.sampling_rows, *firsts)
        elif self.sampled is not None:
            output.set_sampled(self.sampling_rows, *self.sampled.to_host(self.meta))
        output.prompt_logprobs = self.prompt_logprobs
        output.draft_token_ids = self.draft_token_ids
        if self.device_drafts is not None:
            output.draft_token_ids = [[] for _ in range(self.num_scheduled)]
            for row, drafts in zip(self.sampling_rows, self.device_drafts.tolist()):
                output.draft_token_ids[row] = drafts[: drafts.index(-1)] if -1 in drafts else drafts
        return output

    @property
    def on_host(self) -> bool:
        """Whether the step has run to its end already (on CPU)."""
        return self.done is None


@dataclass
class DeferredModelStep:
    """A step whose forward pass is enqueued and whose sampling waits for its grammars' masks:
    wait() enqueues the sampling once they are filled, then waits for the ids."""

    sample: Callable[[], LaunchedModelStep]
    on_host = False

    def wait(self) -> ModelRunnerOutput:
        return self.sample().wait()


@dataclass
class ForwardedStep:
    """A step enqueued up to its logits, and what its sampling needs."""

    scheduler_output: SchedulerOutput
    inputs: StepInputs
    prompt_spans: list[PromptSpan]
    drafts: list[list[int]]
    layout: DraftLayout
    constrained: list  # of ConstrainedRow
    hidden: torch.Tensor | None
    logits: torch.Tensor
    aux_hidden: list[torch.Tensor]
    meta: SamplingMetadata | None


def _copy_to_host(sampled: SamplerOutput) -> SamplerOutput:
    """Non-blocking copies into pinned memory, readable once the step's event has happened."""

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu", non_blocking=True)

    logprobs = sampled.logprobs
    if logprobs is not None:
        fields = dataclasses.fields(logprobs)
        logprobs = LogprobsTensors(*(copy(getattr(logprobs, f.name)) for f in fields))
    return SamplerOutput(copy(sampled.sampled_token_ids), logprobs)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.model.device
        self.block_size = config.cache.block_size
        scheduler = config.scheduler
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # all the runner keeps is allocated and filled on its own stream, which orders every use
        # of it. On the default stream, a second engine's first graph warm-up (its kernels long
        # compiled) ran before its buffers were filled and read a freed engine's memory as token
        # ids and block tables (index out of bounds, illegal address); and freed, the memory
        # goes to no other stream (another engine's) while this one may still use it
        with _stream_context(self.stream):
            backend = make_attention_backend(config.model.attention_backend)
            kernel_build = start_kernel_build(backend, self.device)
            self.model: CausalLM = load_model(config.model, backend)
            num_rows = InputBatch.rows_for(scheduler.max_num_seqs)
            self.drafter = load_worker_proposer(config, self.model, backend, num_rows)
            warm_up_packed_linears(
                self.model, scheduler.max_num_batched_tokens, scheduler.max_num_seqs
            )
            if kernel_build is not None:
                kernel_build.join()
            # every rank's cache holds the same blocks: the scheduler sees one block table
            self.num_blocks = tensor_model_parallel_min(self._num_kv_blocks())
            self.kv_caches = self._allocate_kv_caches(self.num_blocks)
            if self.drafter is not None:
                self.drafter.kv_cache.allocate(self.num_blocks, self.block_size)
            self._report_kv_cache()
            self.sampler = Sampler(getattr(config.args, "logprobs_mode", "raw_logprobs"))
            self.sampling_state = SamplingState(self.device, config.model.hf_config.vocab_size)
            # made at the first constrained request (xgrammar is an optional dependency)
            self.grammar_matchers = None
            self.input_batch = InputBatch(
                max_num_reqs=scheduler.max_num_seqs,
                max_num_tokens=scheduler.max_num_batched_tokens,
                max_model_len=config.model.max_model_len,
                block_size=self.block_size,
                device=self.device,
            )
            self.planner = self._step_planner(backend)
            self.graphs = self._capture_graphs()
        self._last_sampled: DeviceTokens | None = None
        # cleared while a launched step's sampling is left to its wait(): the next launch
        # follows it on the stream, and reads its sampled ids and histories
        self._sampling_enqueued = threading.Event()
        self._sampling_enqueued.set()
        self._no_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)

    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> LaunchedModelStep | DeferredModelStep:
        """Enqueues one step on the runner's own CUDA stream (on CPU: runs it); the step's
        wait() gives its output. A step with grammars is enqueued up to its logits, and its
        wait() enqueues the sampling once the masks are filled (the masks need the step
        before's ids: the caller takes that step in meanwhile, rather than waiting here)."""
        self._sampling_enqueued.wait()  # the step before's sampling, if its wait() enqueues it
        with torch.inference_mode(), _stream_context(self.stream):
            try:
                forwarded = self._forward_step(scheduler_output)
            except BaseException:
                self._lose_sampled()
                raise
            if forwarded.constrained and self._samples_later:
                self._sampling_enqueued.clear()
                return DeferredModelStep(functools.partial(self._sample_later, forwarded))
            return self._sample_or_lose(forwarded)

    @property
    def _samples_later(self) -> bool:
        """Whether a step with grammars leaves its sampling to its wait(): under async
        scheduling (the caller has the step before to take in meanwhile), and without a draft
        model (its drafts read the requests, which the caller updates meanwhile)."""
        return self.config.async_scheduling and self.drafter is None

    def _sample_later(self, forwarded: ForwardedStep) -> LaunchedModelStep:
        """On the thread that waits for the step: its sampling enqueued once the grammars'
        masks are filled, while the caller's thread takes in the step before and schedules."""
        try:
            with torch.inference_mode(), _stream_context(self.stream):
                return self._sample_or_lose(forwarded)
        finally:
            self._sampling_enqueued.set()

    def _sample_or_lose(self, forwarded: ForwardedStep) -> LaunchedModelStep:
        try:
            return self._sample_step(forwarded)
        except BaseException:
            self._lose_sampled()
            raise

    def _lose_sampled(self) -> None:
        # what the step would have sampled is lost: the engine fails its requests, and the
        # step launched behind it runs on for the others
        self._last_sampled = DeviceTokens(self._no_tokens, {}, lost=True)

    def _forward_step(self, scheduler_output: SchedulerOutput) -> ForwardedStep:
        """The step up to its logits, enqueued; the grammars' masks start filling."""
        self._forget(scheduler_output.finished_req_ids)
        # a preempted request's token in flight is dropped: its history restarts from the host
        self.sampling_state.forget(scheduler_output.preempted_req_ids)
        self._forget_grammars(scheduler_output.preempted_req_ids)
        prompt_spans = self._prompt_spans(scheduler_output)
        # a proposer reading the target's hidden states needs them kept in every step
        reads_hidden = self.drafter is not None and self.drafter.reads_hidden
        plan = self.planner.plan(scheduler_output, scores_prompt=bool(prompt_spans) or reads_hidden)
        inputs = self.input_batch.prepare(scheduler_output, plan, self._last_sampled)
        drafts = [scheduler_output.scheduled[r].spec_token_ids for r in inputs.sampling_rows]
        layout = DraftLayout.of(drafts)
        constrained = self._constrained_rows(scheduler_output, inputs.sampling_rows, layout.starts)
        hidden, logits, aux_hidden = self._forward_and_fill(plan, inputs, constrained)
        meta = None
        if inputs.sampling_rows:  # read before the caller takes in the step before
            meta = self._sampling_metadata(scheduler_output, inputs.sampling_rows)
        return ForwardedStep(
            scheduler_output,
            inputs,
            prompt_spans,
            drafts,
            layout,
            constrained,
            hidden,
            logits,
            aux_hidden,
            meta,
        )

    def _sample_step(self, forwarded: ForwardedStep) -> LaunchedModelStep:
        """The forwarded step's sampling (masked by the grammars), drafts and prompt logprobs
        enqueued, their results copied to the host."""
        scheduler_output, inputs = forwarded.scheduler_output, forwarded.inputs
        drafts, constrained, logits = forwarded.drafts, forwarded.constrained, forwarded.logits
        meta = forwarded.meta
        sampled = verification = draft_token_ids = next_token_ids = device_drafts = None
        if inputs.sampling_rows:
            # masked before the sampler processes the logits
            if constrained:
                bitmask = self.grammar_matchers.bitmask(constrained, logits.shape[0])
                apply_token_bitmask(logits, bitmask)
            if any(drafts):
                scored_ids = inputs.input_ids[inputs.logits_indices]
                verification = verify_drafts(
                    self.sampler, logits, meta, forwarded.layout, scored_ids
                )
                next_token_ids = verification.next_token_ids
            else:
                sampled = self.sampler(logits, meta)
                next_token_ids = sampled.sampled_token_ids
            self.sampling_state.record_sampled(meta, next_token_ids)
            ids = [
                scheduler_output.scheduled[row].request.request_id for row in inputs.sampling_rows
            ]
            if self.drafter is not None and self.drafter.drafts_on_device:
                batch = self._draft_batch(
                    scheduler_output, inputs, forwarded.hidden, next_token_ids, verification
                )
                device_drafts = self.drafter.propose(batch)
            self._last_sampled = DeviceTokens(
                next_token_ids,
                dict(zip(ids, range(len(ids)))),
                drafts=device_drafts,
                num_rejected=None if verification is None else verification.num_rejected,
            )
        if self.drafter is not None and not self.drafter.drafts_on_device:
            forward = TargetForward(
                inputs.input_ids,
                inputs.positions,
                inputs.meta,
                forwarded.hidden,
                forwarded.aux_hidden,
            )
            draft_token_ids = self._draft(
                scheduler_output, inputs, forward, next_token_ids, verification
            )
        if verification is not None:
            rows = (scheduler_output.scheduled[r].request for r in inputs.sampling_rows)
            self.sampling_state.forget(counts_moved_on(rows, drafts))
            verification = verification.copy_to_host()
        elif sampled is not None:
            sampled = _copy_to_host(sampled)
        if device_drafts is not None:
            device_drafts = device_drafts.to("cpu", non_blocking=True)
        prompt_logprobs = {}
        if forwarded.prompt_spans:
            prompt_logprobs = compute_prompt_logprobs(
                forwarded.hidden, forwarded.prompt_spans, self.model.compute_logits
            )
        done = self._record_event()
        if constrained:  # the rows' tokens, for the matchers to take in
            host = sampled if verification is None else verification.sampled
            num_accepted = None if verification is None else verification.num_accepted
            token_ids = host.sampled_token_ids
            self.grammar_matchers.record_sampled(constrained, token_ids, num_accepted, done)
        return LaunchedModelStep(
            len(scheduler_output.scheduled),
            inputs.sampling_rows,
            sampled,
            meta,
            prompt_logprobs,
            done,
            verification,
            draft_token_ids,
            device_drafts,
        )

    def _draft(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        forward: TargetForward,
        next_token_ids: torch.Tensor | None,
        verification: DraftVerification | None,
    ) -> list[list[int]]:
        """The proposer's drafts after this step's tokens, per scheduled request; where the
        request's next token sits depends on how many drafts were accepted (read here)."""
        scheduled = scheduler_output.scheduled
        sampling = [scheduled[r] for r in inputs.sampling_rows]
        accepted = [0] * len(sampling)
        if verification is not None:
            accepted = verification.num_accepted.tolist()
        batch = self.input_batch
        tables = batch.block_table[[batch.rows[s.request.request_id] for s in sampling]]
        limits = DraftLimits(
            self.block_size,
            self.config.model.max_model_len,
            self.config.speculative.num_speculative_tokens,
        )
        step = target_step(
            forward, scheduled, inputs.sampling_rows, next_token_ids, accepted, tables, limits
        )
        per_request: list[list[int]] = [[] for _ in scheduled]
        for row, row_drafts in zip(inputs.sampling_rows, self.drafter.draft(step)):
            per_request[row] = row_drafts
        return per_request

    def _draft_batch(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        hidden: torch.Tensor | None,
        next_token_ids: torch.Tensor,
        verification: DraftVerification | None,
    ) -> DraftBatch:
        """The step as a proposer on the device reads it: nothing here waits for the device."""
        scheduled = scheduler_output.scheduled
        num_tokens = len(inputs.token_rows)
        sampled_rows = torch.arange(inputs.padded_tokens, device=self.device)
        sampled_rows = sampled_rows[inputs.logits_indices]
        if verification is not None:
            sampled_rows = sampled_rows[verification.next_scored]
        sampling = [scheduled[r] for r in inputs.sampling_rows]
        rows = np.concatenate([inputs.token_rows, inputs.batch_rows[inputs.sampling_rows]])
        flat = to_device(rows.astype(np.int64), self.device)
        known = [
            (
                int(inputs.batch_rows[i]),
                scheduled[i].request.all_token_ids[: scheduled[i].num_computed_tokens],
            )
            for i in inputs.new_rows
        ]
        # scheduled ahead, a step's start counts the drafts in flight as accepted: a bound
        max_len = max(s.num_computed_tokens + s.num_new_tokens + 1 for s in sampling)
        return DraftBatch(
            input_ids=inputs.input_ids[:num_tokens],
            positions=inputs.positions[:num_tokens],
            token_rows=flat[:num_tokens],
            known=known,
            rows=flat[num_tokens:],
            next_token_ids=next_token_ids,
            next_positions=inputs.positions[sampled_rows] + 1,
            max_len=min(max_len, self.config.model.max_model_len),
            hidden=hidden,
            sampled_rows=sampled_rows,
        )

    def _forward_and_fill(
        self, plan: StepPlan, inputs: StepInputs, constrained: list
    ) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
        """_forward, and the grammars' masks started filling on the matchers' thread (a mask
        for each draft position and the one after). On a GPU the fill starts once the forward
        pass is enqueued: xgrammar holds the GIL throughout, which enqueueing needs while the
        device waits; on CPU it starts first, to run beside the forward pass."""
        fill_first = self.stream is None
        if constrained and fill_first:
            self.grammar_matchers.start_fill(constrained)
        forwarded = self._forward(plan, inputs)
        if constrained and not fill_first:
            self.grammar_matchers.start_fill(constrained)
        return forwarded

    def _forward(
        self, plan: StepPlan, inputs: StepInputs
    ) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
        """(hidden states, logits of the sampling rows, the states entering the layers an
        EAGLE-3 head reads); a pure-decode step keeps no hidden states."""
        aux_layers = self._aux_layers()
        if aux_layers:  # read inside the model: these steps run eagerly
            hidden, aux = self.model.hidden_states(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, aux_layers
            )
            return hidden, self.model.compute_logits(hidden[inputs.logits_indices]), aux
        output = self._model_output(plan, inputs)
        if plan.pure_decode:
            return None, output[inputs.logits_indices], []
        return output, self.model.compute_logits(output[inputs.logits_indices]), []

    def _aux_layers(self) -> tuple[int, ...]:
        return () if self.drafter is None else self.drafter.aux_layers

    def _model_output(self, plan: StepPlan, inputs: StepInputs) -> torch.Tensor:
        """What the plan's runner computes: for a pure-decode step the logits of every row, as
        the decode graphs do, else the hidden states."""
        graphs = self.graphs.get(plan.runner)
        if graphs is not None:
            return graphs.run(plan.num_tokens, inputs.meta)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return self.model.compute_logits(hidden) if plan.pure_decode else hidden

    def _prompt_spans(self, scheduler_output: SchedulerOutput) -> list[PromptSpan]:
        spans, offset = [], 0
        for s in scheduler_output.scheduled:
            if (span := prompt_span(s, offset)) is not None:
                spans.append(span)
            offset += s.num_new_tokens
        return spans

    def _record_event(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        # blocking: the collector thread sleeps in the wait instead of spinning in the driver
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event

    def _step_planner(self, backend: AttentionBackend) -> StepPlanner:
        """Steps pad to graph sizes on CUDA with the Triton backend; elsewhere (the torch
        backend reads host metadata in every layer) they run as scheduled."""
        model, scheduler = self.config.model, self.config.scheduler
        if self.device.type != "cuda" or model.attention_backend != "triton":
            return StepPlanner()
        return StepPlanner.from_limits(
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
            backend.max_short_step_tokens,
            graphs=not model.enforce_eager and not self._aux_layers(),
            num_speculative_tokens=scheduler.num_lookahead_tokens,
        )

    def _capture_graphs(self) -> dict[StepRunner, GraphRunner]:
        graphs = {}
        for runner, kind in _GRAPH_KINDS.items():
            plans = self.planner.graph_plans(runner)
            if plans:
                graphs[runner] = kind(
                    self.model, self.kv_caches, self.input_batch, plans, self.stream
                )
                graphs[runner].capture()
        return graphs

    def _sampling_metadata(
        self, scheduler_output: SchedulerOutput, rows: list[int]
    ) -> SamplingMetadata:
        return self.sampling_state.metadata([scheduler_output.scheduled[r].request for r in rows])

    def _forget(self, request_ids: set[str]) -> None:
        self.input_batch.remove_requests(request_ids)
        self.sampling_state.forget(request_ids)
        self._forget_grammars(request_ids)

    def _forget_grammars(self, request_ids: set[str]) -> None:
        if self.grammar_matchers is not None:
            self.grammar_matchers.forget(request_ids)

    def _constrained_rows(
        self, scheduler_output: SchedulerOutput, rows: list[int], logits_rows: list[int]
    ) -> list:
        """The ConstrainedRows of the requests with a structured-output grammar; logits_rows:
        each sampling row's first row of logits."""
        scheduled = [scheduler_output.scheduled[r] for r in rows]
        if all(s.request.grammar is None for s in scheduled):
            return []
        from asyncllm.structured_output.compiler import model_vocabulary
        from asyncllm.structured_output.matchers import (
            GrammarMatchers,
            constrained_rows,
            wants_grammar_process,
        )

        if self.grammar_matchers is None:
            grammar = next(s.request.grammar for s in scheduled if s.request.grammar is not None)
            # the tokenizer's vocabulary, which the logits may pad (every grammar has the same)
            vocab_size = grammar.tokenizer_info.vocab_size
            scheduler = self.config.scheduler
            # a row of logits per draft position and one after
            max_rows = scheduler.max_num_seqs * (1 + scheduler.num_lookahead_tokens)
            # the grammar process compiles against the same vocabulary
            vocabulary = model_vocabulary(self.config.model) if wants_grammar_process() else None
            self.grammar_matchers = GrammarMatchers(vocab_size, max_rows, self.device, vocabulary)
        return constrained_rows(scheduled, logits_rows)

    def _bytes_per_block(self) -> int:
        dtype = self._kv_cache_dtype()
        size = sum(spec.block_bytes(self.block_size, dtype) for spec in self.model.kv_cache_specs)
        if self.drafter is not None:
            size += self.drafter.kv_cache.bytes_per_block(self.block_size)
        return size

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        budget = cache.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = (
                int(total * cache.gpu_memory_utilization) - used - _GPU_ACTIVATION_RESERVE_BYTES
            )
        per_block = self._bytes_per_block()
        num_blocks = self._cpu_kv_blocks() if budget is None else budget // per_block
        if num_blocks < 2:
            raise ValueError("kv_cache_memory is too small to hold two KV blocks.")
        return num_blocks

    def _cpu_kv_blocks(self) -> int:
        """What max_num_seqs sequences of max_model_len tokens can use, bounded by
        _CPU_KV_CACHE_BYTES (but never below one whole sequence): on CPU, memory is the RSS of
        the process, and each block is touched as it is zeroed."""
        scheduler = self.config.scheduler
        per_sequence = -(-scheduler.max_model_len // self.block_size)
        bounded = max(_CPU_KV_CACHE_BYTES // self._bytes_per_block(), per_sequence)
        return min(scheduler.max_num_seqs * per_sequence, bounded)

    def _report_kv_cache(self) -> None:
        tokens = self.num_blocks * self.block_size
        size_mib = self.num_blocks * self._bytes_per_block() / (1 << 20)
        length = self.config.scheduler.max_model_len
        logger.info(
            "KV cache: %d blocks of %d tokens, %d tokens (%.0f MiB, %.1f sequences of "
            "max_model_len %d; --kv-cache-memory or --num-kv-blocks to change)",
            self.num_blocks, self.block_size, tokens, size_mib, tokens / length, length,
        )  # fmt: skip

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        dtype = self._kv_cache_dtype()
        return [
            torch.zeros(spec.shape(num_blocks, self.block_size), dtype=dtype, device=self.device)
            for spec in self.model.kv_cache_specs
        ]

    def _kv_cache_dtype(self) -> torch.dtype:
        dtype = self.config.cache.cache_dtype(self.config.model.dtype)
        latent = any(spec.num_planes == 1 for spec in self.model.kv_cache_specs)
        if latent and dtype != self.config.model.dtype:
            raise ValueError(
                "kv_cache_dtype fp8 is for key/value caches: the latent cache of an MLA model "
                "(DeepSeek-V2) keeps the model's dtype"
            )
        return dtype
