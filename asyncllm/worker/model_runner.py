"""Runs one scheduled step: flat batch -> model -> sampled ids, in a worker thread.

`execute()` returns a concurrent future at once; the engine task awaits it, so the event loop
keeps serving while the model computes (torch releases the GIL inside its kernels).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.models.loader import load_model
from asyncllm.sample.logprobs import PromptSpan, compute_prompt_logprobs, prompt_span
from asyncllm.sample.metadata import SamplingMetadata, TokenHistory
from asyncllm.sample.sampler import Sampler

_CPU_KV_CACHE_BYTES = 2 << 30
_GPU_ACTIVATION_RESERVE_BYTES = 4 << 30


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last row of every request that samples this step
    sampling_rows: list[int]  # scheduled index of each logits row
    prompt_spans: list[PromptSpan]  # prompt positions to score, for prompt_logprobs


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
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-runner")

    def execute(
        self, scheduler_output: SchedulerOutput
    ) -> concurrent.futures.Future[ModelRunnerOutput]:
        return self._executor.submit(self.execute_model, scheduler_output)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._forget(scheduler_output.finished_req_ids)
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        output = ModelRunnerOutput(sampled_token_ids=[None] * len(scheduler_output.scheduled))
        if inputs.sampling_rows:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            meta = self._sampling_metadata(scheduler_output, inputs.sampling_rows)
            output.set_sampled(inputs.sampling_rows, *self.sampler(logits, meta).to_host(meta))
        if inputs.prompt_spans:
            output.prompt_logprobs = compute_prompt_logprobs(
                hidden, inputs.prompt_spans, self.model.compute_logits
            )
        return output

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sampling_rows: list[int] = []
        prompt_spans: list[PromptSpan] = []
        bs = self.block_size
        for row, s in enumerate(scheduler_output.scheduled):
            if (scored := prompt_span(s, len(input_ids))) is not None:
                prompt_spans.append(scored)
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            input_ids += s.request.all_token_ids[start:end]
            span = range(start, end)
            positions += span
            slots += [s.block_ids[p // bs] * bs + p % bs for p in span]
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            tables.append(s.block_ids)
            if s.completes_prompt:
                logits_indices.append(len(input_ids) - 1)
                sampling_rows.append(row)
        meta = self._attention_metadata(query_lens, seq_lens, tables, slots)
        return ModelInputs(
            input_ids=self._tensor(input_ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            meta=meta,
            logits_indices=self._tensor(logits_indices, torch.int64),
            sampling_rows=sampling_rows,
            prompt_spans=prompt_spans,
        )

    def _attention_metadata(
        self, query_lens: list[int], seq_lens: list[int], tables: list[list[int]], slots: list[int]
    ) -> AttentionMetadata:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            query_start_loc=self._tensor(starts, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(padded, torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )

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

    def _forget(self, request_ids: set[str]) -> None:
        self.token_history.forget(request_ids)
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

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
