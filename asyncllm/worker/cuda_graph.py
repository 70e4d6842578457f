"""Steps replayed from CUDA graphs captured once at a ladder of sizes.

Pure-decode steps replay one graph of the whole forward pass per batch size. Steps with prompt
tokens do too, per token count, up to the size whose attention reads no host metadata (the
backend's max_short_step_tokens): their requests are padded to the graph's capacity with
requests of no tokens. Bigger steps replay piecewise graphs: everything between two attentions
is a graph, and each layer's attention runs eagerly on the step's own metadata (its launches
depend on how the tokens split into requests), so such a step launches L + 1 graphs and L or
2L attention kernels instead of about ten kernels per layer from Python.

A graph reads its inputs from InputBatch's fixed device buffers, so a replay is: fill the
buffers (padding up to the graph's size), replay, read the rows that sample.
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


def token_count_ladder(max_tokens: int, cap: int = 16384) -> list[int]:
    """Token counts for the graphs of steps with prompt tokens: steps of 64 up to 512, then of
    128, 256, 512 and 1024 from 512, 1024, 2048 and 4096 on, up to cap (padding under 64
    tokens, or under a quarter of the step's), and max_tokens itself when it is below cap.
    Even big steps need graphs: launched eagerly, an 8,192-token step of Qwen3-0.6B took 17-24
    ms of host time on the H200, more than its GPU time (`bench/NOTES.md`, change 26)."""
    ladder = [
        *range(64, 512, 64),
        *range(512, 1024, 128),
        *range(1024, 2048, 256),
        *range(2048, 4096, 512),
        *range(4096, cap + 1, 1024),
    ]
    sizes = [size for size in ladder if size < max_tokens and size <= cap]
    return sizes + [max_tokens] if max_tokens <= cap else sizes


def _static_meta(
    input_batch: InputBatch, num_reqs: int, num_tokens: int, max_query_len: int
) -> AttentionMetadata:
    """Metadata over the fixed device buffers, for capture (host fields are placeholders)."""
    return AttentionMetadata(
        query_start_loc=input_batch.query_start_loc.device[: num_reqs + 1],
        seq_lens=input_batch.seq_lens.device[:num_reqs],
        block_tables=input_batch.block_tables.device[:num_reqs],
        slot_mapping=input_batch.slot_mapping.device[:num_tokens],
        max_query_len=max_query_len,
        max_seq_len=input_batch.max_model_len,
        query_lens_cpu=[1] * num_reqs,
        seq_lens_cpu=[1] * num_reqs,
    )


class _GraphRunner:
    """What both kinds of graphs run over: the model, its KV caches, the input buffers, the
    sizes to capture, and the runner's stream."""

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
        self.sizes = sizes
        self.stream = stream


class _WholeStepGraphs(_GraphRunner):
    """One graph per size of the whole forward pass; subclasses say what the padding in the
    buffers is at capture and what the pass computes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

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
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
                pool = graph.pool()
        self.stream.synchronize()
        logger.info(
            "captured %d %s graphs in %.1f s",
            len(self.sizes),
            type(self).__name__,
            time.perf_counter() - start,
        )

    def replay(self, size: int) -> torch.Tensor:
        """The pass's output; the step's inputs must already be in the device buffers."""
        self.graphs[size].replay()
        return self.outputs[size]

    def _fill_padding(self, size: int) -> None:
        raise NotImplementedError

    def _forward(self, size: int) -> torch.Tensor:
        raise NotImplementedError


class CudaGraphRunner(_WholeStepGraphs):
    """Pure-decode steps, per batch size: logits [size, vocab]."""

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
        meta = _static_meta(batch, size, size, max_query_len=1)
        hidden = self.model(
            batch.input_ids.device[:size], batch.positions.device[:size], self.kv_caches, meta
        )
        return self.model.compute_logits(hidden)


class MixedGraphRunner(_WholeStepGraphs):
    """Steps with prompt tokens, attention included, per token count: hidden states
    [size, hidden]. A graph takes capacity(size) requests: the real ones, then requests of no
    tokens."""

    def capacity(self, size: int) -> int:
        """Each real request has a token at least."""
        return min(size, self.input_batch.max_num_reqs)

    def _fill_padding(self, size: int) -> None:
        batch, reqs = self.input_batch, self.capacity(size)
        batch.pad_tokens(0, size)  # captures write no KV
        batch.query_start_loc.np[0] = 0
        batch.pad_empty_requests(0, reqs, 0)
        for buffer in (batch.input_ids, batch.positions, batch.slot_mapping):
            buffer.copy_rows(size)
        batch.query_start_loc.copy_rows(reqs + 1)
        batch.seq_lens.copy_rows(reqs)

    def _forward(self, size: int) -> torch.Tensor:
        batch = self.input_batch
        meta = _static_meta(batch, self.capacity(size), size, max_query_len=size)
        return self.model(
            batch.input_ids.device[:size], batch.positions.device[:size], self.kv_caches, meta
        )


class PiecewiseGraphRunner(_GraphRunner):
    """Graph i (0 < i < L) is layer i-1 after its attention, then layer i up to its query;
    graph 0 starts at the embedding, graph L ends at the final norm. Between graphs, queries,
    attention outputs and the residual stream sit in fixed buffers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        attn = self.model.layers[0].self_attn
        hidden_size = self.model.config.hidden_size
        rows, like = max(self.sizes), self.kv_caches[0]
        self.query = like.new_zeros(rows, attn.num_heads, attn.head_dim)
        self.attn_out = like.new_zeros(rows, attn.num_heads, attn.head_dim)
        self.residual = like.new_zeros(rows, hidden_size)
        self.hidden = like.new_zeros(rows, hidden_size)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        batch, rows = self.input_batch, max(self.sizes)
        batch.pad_tokens(0, rows)  # captures write no KV
        for buffer in (batch.input_ids, batch.positions, batch.slot_mapping):
            buffer.copy_rows(rows)
        pool = None
        with torch.cuda.stream(self.stream):
            for size in reversed(self.sizes):
                self.graphs[size] = []
                for piece in range(len(self.model.layers) + 1):
                    self._piece(piece, size)  # warm-up: triton compiles outside capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                        self._piece(piece, size)
                    self.graphs[size].append(graph)
                    pool = graph.pool()
            self._compile_attention(min(self.sizes))
        self.stream.synchronize()
        logger.info(
            "captured piecewise CUDA graphs for %d token counts in %.1f s",
            len(self.sizes),
            time.perf_counter() - start,
        )

    def run(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [size, hidden]; the step's inputs must be in the device buffers,
        padded to size, and meta is the step's own."""
        graphs = self.graphs[size]
        query, attn_out = self.query[:size], self.attn_out[:size]
        for graph, layer, kv_cache in zip(graphs, self.model.layers, self.kv_caches):
            graph.replay()
            layer.self_attn.attend(query, kv_cache, meta, out=attn_out)
        graphs[-1].replay()
        return self.hidden[:size]

    def _compile_attention(self, size: int) -> None:
        """Attention runs eagerly between the graphs: run it once, for one request of `size`
        queries, so that its kernel is compiled before serving (a compile mid-run stalls every
        stream for seconds)."""
        tokens = min(size, self.input_batch.max_model_len)
        device = self.query.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
            block_tables=self.input_batch.block_tables.device[:1],
            slot_mapping=self.input_batch.slot_mapping.device[:tokens],
            max_query_len=size,
            max_seq_len=tokens,
            query_lens_cpu=[tokens],
            seq_lens_cpu=[tokens],
        )
        attention = self.model.layers[0].self_attn
        attention.attend(self.query[:size], self.kv_caches[0], meta, out=self.attn_out[:size])

    def _piece(self, index: int, size: int) -> None:
        batch, model, layers = self.input_batch, self.model, self.model.layers
        if index == 0:
            x, residual = model.embed_tokens(batch.input_ids.device[:size]), None
        else:
            layer = layers[index - 1]
            x, residual = layer.after_attention(self.attn_out[:size], self.residual[:size])
        if index == len(layers):
            self.hidden[:size].copy_(model.norm(x, residual)[0])
            return
        meta = _static_meta(batch, size, size, max_query_len=size)
        positions, kv_cache = batch.positions.device[:size], self.kv_caches[index]
        query, residual = layers[index].before_attention(positions, x, residual, kv_cache, meta)
        self.query[:size].copy_(query)
        if residual.data_ptr() != self.residual.data_ptr():
            self.residual[:size].copy_(residual)
