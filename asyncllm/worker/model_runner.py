"""Runs one scheduled step: flat batch -> model -> sampled ids.

`execute_model()` prepares the step and enqueues it on the runner's own CUDA stream (inputs
copied from pinned buffers without blocking, steps replaying CUDA graphs, sampled ids copied back
without blocking) and returns before it has run, so the caller can launch step N+1 while step N
still runs, its input tokens taken from the ids N samples on the device (async scheduling). The
launched step's wait() blocks until the ids are on the host. On CPU the step runs to its end
inside execute_model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.layers.linear import warm_up_packed_linears
from asyncllm.models.loader import load_model
from asyncllm.outputs import PromptLogprobsChunk
from asyncllm.sample.logprobs import (
    LogprobsTensors,
    PromptSpan,
    compute_prompt_logprobs,
    prompt_span,
)
from asyncllm.sample.metadata import SamplingMetadata
from asyncllm.sample.sampler import Sampler, SamplerOutput
from asyncllm.sample.state import SamplingState
from asyncllm.worker.cuda_graph import (
    CudaGraphRunner,
    MixedGraphRunner,
    PiecewiseGraphRunner,
    batch_size_ladder,
    token_count_ladder,
)
from asyncllm.worker.input_batch import DeviceTokens, InputBatch, StepInputs

GraphRunner = TypeVar("GraphRunner", CudaGraphRunner, MixedGraphRunner, PiecewiseGraphRunner)

_CPU_KV_CACHE_BYTES = 2 << 30
_GPU_ACTIVATION_RESERVE_BYTES = 4 << 30
_MAX_CUDA_GRAPH_BATCH = 512


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


@dataclass
class LaunchedModelStep:
    """A step enqueued on the device; wait() turns it into the ModelRunnerOutput."""

    num_scheduled: int
    sampling_rows: list[int]
    sampled: SamplerOutput | None  # host tensors, filled once `done` has happened
    meta: SamplingMetadata | None
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    done: torch.cuda.Event | None  # None on CPU, where the step ran to its end already

    def wait(self) -> ModelRunnerOutput:
        """Blocks this thread (Event.synchronize releases the GIL) until the ids are here."""
        if self.done is not None:
            self.done.synchronize()
        output = ModelRunnerOutput(sampled_token_ids=[None] * self.num_scheduled)
        if self.sampled is not None:
            output.set_sampled(self.sampling_rows, *self.sampled.to_host(self.meta))
        output.prompt_logprobs = self.prompt_logprobs
        return output


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
        backend = make_attention_backend(config.model.attention_backend)
        self.model = load_model(config.model, backend)
        # steps with prompt tokens up to this size run whole in CUDA graphs
        self.max_whole_mixed_tokens = getattr(backend, "max_short_step_tokens", 0)
        scheduler = config.scheduler
        warm_up_packed_linears(self.model, scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self.sampler = Sampler(getattr(config.args, "logprobs_mode", "raw_logprobs"))
        self.sampling_state = SamplingState(self.device, config.model.hf_config.vocab_size)
        self.input_batch = InputBatch(
            max_num_reqs=scheduler.max_num_seqs,
            max_num_tokens=scheduler.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
            block_size=self.block_size,
            device=self.device,
        )
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.decode_sizes = self._decode_sizes()
        self.mixed_sizes = self._mixed_sizes()
        whole_sizes = [s for s in self.mixed_sizes if s <= self.max_whole_mixed_tokens]
        self.cuda_graphs = self._capture(CudaGraphRunner, self.decode_sizes)
        self.mixed_graphs = self._capture(MixedGraphRunner, whole_sizes)
        self.piecewise_graphs = self._capture(
            PiecewiseGraphRunner, [s for s in self.mixed_sizes if s not in whole_sizes]
        )
        self._last_sampled: DeviceTokens | None = None
        self._no_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> LaunchedModelStep:
        """Enqueues one step on the runner's own CUDA stream (on CPU: runs it); the step's
        wait() gives its output."""
        with torch.inference_mode(), _stream_context(self.stream):
            try:
                return self._launch(scheduler_output)
            except BaseException:
                # what it would have sampled is lost: the engine fails its requests, and the
                # step launched behind it runs on for the others
                self._last_sampled = DeviceTokens(self._no_tokens, {}, lost=True)
                raise

    def _launch(self, scheduler_output: SchedulerOutput) -> LaunchedModelStep:
        self._forget(scheduler_output.finished_req_ids)
        # a preempted request's token in flight is dropped: its history restarts from the host
        self.sampling_state.forget(scheduler_output.preempted_req_ids)
        prompt_spans = self._prompt_spans(scheduler_output)
        decode_size = self._decode_batch_size(scheduler_output, prompt_spans)
        mixed_size = None if decode_size is not None else self._mixed_size(scheduler_output)
        whole = self._replays_mixed_graph(scheduler_output, mixed_size)
        inputs = self.input_batch.prepare(
            scheduler_output,
            decode_size,
            self._last_sampled,
            pad_tokens_to=mixed_size,
            empty_reqs_to=self.mixed_graphs.capacity(mixed_size) if whole else None,
        )
        hidden = None
        if decode_size is not None:
            logits = self._decode_logits(inputs, decode_size)[inputs.logits_indices]
        else:
            hidden = self._mixed_hidden(inputs, mixed_size, whole)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        sampled = meta = None
        if inputs.sampling_rows:
            meta = self._sampling_metadata(scheduler_output, inputs.sampling_rows)
            sampled = self.sampler(logits, meta)
            self.sampling_state.record_sampled(meta, sampled.sampled_token_ids)
            ids = [
                scheduler_output.scheduled[row].request.request_id for row in inputs.sampling_rows
            ]
            self._last_sampled = DeviceTokens(
                sampled.sampled_token_ids, dict(zip(ids, range(len(ids))))
            )
            sampled = _copy_to_host(sampled)
        prompt_logprobs = {}
        if prompt_spans:
            prompt_logprobs = compute_prompt_logprobs(
                hidden, prompt_spans, self.model.compute_logits
            )
        return LaunchedModelStep(
            len(scheduler_output.scheduled),
            inputs.sampling_rows,
            sampled,
            meta,
            prompt_logprobs,
            self._record_event(),
        )

    def _decode_batch_size(
        self, scheduler_output: SchedulerOutput, prompt_spans: list[PromptSpan]
    ) -> int | None:
        """For a pure-decode step on the GPU, the padded batch size of its CUDA graph; else None.
        A step that scores prompt tokens (prompt_spans) needs the hidden states, which the
        graphs do not keep.

        With graphs off (enforce_eager) such steps still run padded, with the graphs' metadata,
        so that both modes launch the same kernels and give bit-identical outputs.
        """
        if not self.decode_sizes:
            return None
        scheduled = scheduler_output.scheduled
        if prompt_spans or any(s.num_new_tokens != 1 for s in scheduled):
            return None
        return next((size for size in self.decode_sizes if size >= len(scheduled)), None)

    def _decode_logits(self, inputs: StepInputs, size: int) -> torch.Tensor:
        """Logits of all `size` padded rows: a graph replay, or the same computation eagerly."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs.replay(size)
        meta = dataclasses.replace(inputs.meta, max_seq_len=self.config.model.max_model_len)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def _mixed_size(self, scheduler_output: SchedulerOutput) -> int | None:
        """For a step with prompt tokens on the GPU, the padded token count of its piecewise
        graphs (None past the largest: it runs unpadded and eagerly). With graphs off such
        steps still run padded, so that both modes give bit-identical outputs."""
        num_tokens = scheduler_output.total_num_scheduled_tokens
        return next((size for size in self.mixed_sizes if size >= num_tokens), None)

    def _replays_mixed_graph(self, scheduler_output: SchedulerOutput, size: int | None) -> bool:
        """Whether a step with prompt tokens replays a whole-step graph: there is one of its
        size, and a query of more than one token (with none, as when a request asks for
        prompt logprobs, attention takes the decode kernel, which those graphs do not hold:
        the step runs eagerly)."""
        return (
            self.mixed_graphs is not None
            and size in self.mixed_graphs.graphs
            and any(s.num_new_tokens > 1 for s in scheduler_output.scheduled)
        )

    def _mixed_hidden(self, inputs: StepInputs, size: int | None, whole: bool) -> torch.Tensor:
        if whole:
            return self.mixed_graphs.replay(size)
        if self.piecewise_graphs is not None and size in self.piecewise_graphs.sizes:
            return self.piecewise_graphs.run(size, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

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

    def _decode_sizes(self) -> list[int]:
        model = self.config.model
        if self.device.type != "cuda" or model.attention_backend != "triton":
            return []
        return batch_size_ladder(min(self.config.scheduler.max_num_seqs, _MAX_CUDA_GRAPH_BATCH))

    def _mixed_sizes(self) -> list[int]:
        if not self.decode_sizes:  # the same conditions: CUDA and the Triton backend
            return []
        return token_count_ladder(self.config.scheduler.max_num_batched_tokens)

    def _capture(self, kind: type[GraphRunner], sizes: list[int]) -> GraphRunner | None:
        if not sizes or self.config.model.enforce_eager:
            return None
        graphs = kind(self.model, self.kv_caches, self.input_batch, sizes, self.stream)
        graphs.capture()
        return graphs

    def _sampling_metadata(
        self, scheduler_output: SchedulerOutput, rows: list[int]
    ) -> SamplingMetadata:
        return self.sampling_state.metadata([scheduler_output.scheduled[r].request for r in rows])

    def _forget(self, request_ids: set[str]) -> None:
        self.input_batch.remove_requests(request_ids)
        self.sampling_state.forget(request_ids)

    def _bytes_per_block(self) -> int:
        num_layers, num_kv_heads, head_dim = self.model.layer_geometry
        element = torch.empty((), dtype=self.config.model.dtype).element_size()
        return 2 * num_layers * self.block_size * num_kv_heads * head_dim * element

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
        budget = budget if budget is not None else _CPU_KV_CACHE_BYTES
        num_blocks = budget // self._bytes_per_block()
        if num_blocks < 2:
            raise ValueError("kv_cache_memory is too small to hold two KV blocks.")
        return num_blocks

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        num_layers, num_kv_heads, head_dim = self.model.layer_geometry
        shape = (2, num_blocks, self.block_size, num_kv_heads, head_dim)
        dtype = self.config.model.dtype
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
