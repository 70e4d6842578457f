"""Runs one scheduled step: flat batch -> model -> sampled ids, in a worker thread.

`execute()` returns a concurrent future at once; the engine task awaits it, so the event loop
keeps serving while the model computes (torch releases the GIL inside its kernels). On CUDA the
step runs on the runner's own stream, inputs are copied from pinned buffers without blocking,
pure-decode steps replay CUDA graphs, and the future completes when the sampled ids are on the host.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.models.loader import load_model
from asyncllm.sample.logprobs import PromptSpan, compute_prompt_logprobs, prompt_span
from asyncllm.sample.metadata import SamplingMetadata, TokenHistory
from asyncllm.sample.sampler import Sampler
from asyncllm.worker.cuda_graph import CudaGraphRunner, batch_size_ladder
from asyncllm.worker.input_batch import InputBatch, StepInputs

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


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.model.device
        self.block_size = config.cache.block_size
        self.model = load_model(
            config.model, make_attention_backend(config.model.attention_backend)
        )
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self.sampler = Sampler(getattr(config.args, "logprobs_mode", "raw_logprobs"))
        self.generators: dict[str, torch.Generator] = {}
        self.token_history = TokenHistory()
        scheduler = config.scheduler
        self.input_batch = InputBatch(
            max_num_reqs=scheduler.max_num_seqs,
            max_num_tokens=scheduler.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
            block_size=self.block_size,
            device=self.device,
        )
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.decode_sizes = self._decode_sizes()
        self.cuda_graphs = self._capture_cuda_graphs()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-runner")

    def execute(
        self, scheduler_output: SchedulerOutput
    ) -> concurrent.futures.Future[ModelRunnerOutput]:
        return self._executor.submit(self.execute_model, scheduler_output)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on the runner's own CUDA stream; returns once the sampled ids are on the host."""
        with torch.inference_mode(), _stream_context(self.stream):
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.forget(scheduler_output.finished_req_ids)
        decode_size = self._decode_batch_size(scheduler_output)
        inputs = self.input_batch.prepare(scheduler_output, pad_to=decode_size)
        prompt_spans = self._prompt_spans(scheduler_output)
        hidden = None
        if decode_size is not None:
            logits = self._decode_logits(inputs, decode_size)[inputs.logits_indices]
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        output = ModelRunnerOutput(sampled_token_ids=[None] * len(scheduler_output.scheduled))
        if inputs.sampling_rows:
            meta = self._sampling_metadata(scheduler_output, inputs.sampling_rows)
            sampled = self.sampler(logits, meta)
            self._wait_for_device()
            output.set_sampled(inputs.sampling_rows, *sampled.to_host(meta))
        if prompt_spans:
            output.prompt_logprobs = compute_prompt_logprobs(
                hidden, prompt_spans, self.model.compute_logits
            )
        return output

    def _decode_batch_size(self, scheduler_output: SchedulerOutput) -> int | None:
        """For a pure-decode step on the GPU, the padded batch size of its CUDA graph; else None.

        With graphs off (enforce_eager) such steps still run padded, with the graphs' metadata,
        so that both modes launch the same kernels and give bit-identical outputs.
        """
        if not self.decode_sizes:
            return None
        scheduled = scheduler_output.scheduled
        if any(
            s.num_new_tokens != 1 or s.request.sampling_params.prompt_logprobs is not None
            for s in scheduled
        ):
            return None
        return next((size for size in self.decode_sizes if size >= len(scheduled)), None)

    def _decode_logits(self, inputs: StepInputs, size: int) -> torch.Tensor:
        """Logits of all `size` padded rows: a graph replay, or the same computation eagerly."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs.replay(size)
        meta = dataclasses.replace(inputs.meta, max_seq_len=self.config.model.max_model_len)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def _prompt_spans(self, scheduler_output: SchedulerOutput) -> list[PromptSpan]:
        spans, offset = [], 0
        for s in scheduler_output.scheduled:
            if (span := prompt_span(s, offset)) is not None:
                spans.append(span)
            offset += s.num_new_tokens
        return spans

    def _wait_for_device(self) -> None:
        """Block this worker thread (never the event loop) until the step's kernels are done;
        Event.synchronize releases the GIL while it waits."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            event.synchronize()

    def _decode_sizes(self) -> list[int]:
        model = self.config.model
        if self.device.type != "cuda" or model.attention_backend != "triton":
            return []
        return batch_size_ladder(min(self.config.scheduler.max_num_seqs, _MAX_CUDA_GRAPH_BATCH))

    def _capture_cuda_graphs(self) -> CudaGraphRunner | None:
        if not self.decode_sizes or self.config.model.enforce_eager:
            return None
        graphs = CudaGraphRunner(
            self.model, self.kv_caches, self.input_batch, self.decode_sizes, self.stream
        )
        graphs.capture()
        return graphs

    def _sampling_metadata(
        self, scheduler_output: SchedulerOutput, rows: list[int]
    ) -> SamplingMetadata:
        requests = [scheduler_output.scheduled[row].request for row in rows]
        generators = {}
        for i, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is not None and not request.sampling_params.greedy:
                generators[i] = self._generator(request.request_id, seed)
        return SamplingMetadata.build(requests, generators, self.device, self.token_history)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[request_id]

    def forget(self, request_ids: set[str]) -> None:
        self.input_batch.remove_requests(request_ids)
        self.token_history.forget(request_ids)
        for request_id in request_ids:
            self.generators.pop(request_id, None)

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
