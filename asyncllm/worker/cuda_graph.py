"""Decode steps replayed from CUDA graphs captured once at a ladder of batch sizes.

A graph reads its inputs from InputBatch's fixed device buffers, so a replay is: fill the
buffers (padding the batch up to the graph's size), replay, read the logits rows that sample.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (as vLLM does)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    return sorted(set(sizes + [max_batch]))


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        input_batch: InputBatch,
        sizes: list[int],
        stream: torch.cuda.Stream,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.input_batch = input_batch
        self.stream = stream
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self._fill_padding(max(self.sizes))
        pool = None
        with torch.cuda.stream(self.stream):
            for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
                graph = torch.cuda.CUDAGraph()
                self._forward(size)  # warm-up: triton compiles and autotunes outside capture
                with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                    self.logits[size] = self._forward(size)
                self.graphs[size] = graph
                pool = graph.pool()
        self.stream.synchronize()
        logger.info(
            "captured %d CUDA graphs in %.1f s", len(self.sizes), time.perf_counter() - start
        )

    def replay(self, size: int) -> torch.Tensor:
        """Logits [size, vocab]; the step's inputs must already be in the device buffers."""
        self.graphs[size].replay()
        return self.logits[size]

    def _fill_padding(self, size: int) -> None:
        batch = self.input_batch
        batch.query_start_loc.np[0] = 0
        batch.pad(0, size)
        for buffer in (
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            batch.seq_lens,
            batch.block_tables,
        ):
            buffer.copy_rows(size)
        batch.query_start_loc.copy_rows(size + 1)

    def _forward(self, size: int) -> torch.Tensor:
        """The decode forward pass over the device buffers: no host data, no copies."""
        batch = self.input_batch
        meta = AttentionMetadata(
            query_start_loc=batch.query_start_loc.device[: size + 1],
            seq_lens=batch.seq_lens.device[:size],
            block_tables=batch.block_tables.device[:size],
            slot_mapping=batch.slot_mapping.device[:size],
            max_query_len=1,
            max_seq_len=batch.max_model_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,
        )
        hidden = self.model(
            batch.input_ids.device[:size], batch.positions.device[:size], self.kv_caches, meta
        )
        return self.model.compute_logits(hidden)
