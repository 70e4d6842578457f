"""Steps replayed from CUDA graphs captured once, one per plan of asyncllm/worker/step_plan.py.

DecodeGraphs: pure-decode steps, one graph of the whole forward pass and the logits per batch
size. ShortStepGraphs: steps with prompt tokens up to the size whose attention reads no host
metadata (the backend's max_short_step_tokens), one graph of the forward pass per token count;
their requests are padded to the graph's fixed count with requests of no tokens. The same
class holds the uniform verify steps of speculative decoding at their own sizes (b requests of
k + 1 tokens; the prefill kernel's short tiles take queries of any length).
PiecewiseGraphs: bigger steps; everything between two attentions is a graph, and each layer's
attention runs eagerly on the step's own metadata (its launches depend on how the tokens split
into requests), so such a step launches L + 1 graphs and L or 2L attention kernels instead of
about ten kernels per layer from Python. They reach the model only through
asyncllm/models/causal_lm.py's CausalLM.

A graph reads its inputs from InputBatch's fixed device buffers, so a replay is: fill the
buffers (padded to the plan), replay, read the rows that sample. Each runner owns its graphs
and their memory pool; captures are thread-local, so that another engine of the process may
keep working meanwhile.
"""

from __future__ import annotations

import logging
import time

import torch

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.models.causal_lm import CausalLM
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.step_plan import StepPlan

logger = logging.getLogger(__name__)


def _static_meta(input_batch: InputBatch, plan: StepPlan, max_query_len: int) -> AttentionMetadata:
    """The plan's metadata over the fixed device buffers, for capture (host fields are
    placeholders)."""
    return AttentionMetadata(
        query_start_loc=input_batch.query_start_loc.device[: plan.num_reqs + 1],
        seq_lens=input_batch.seq_lens.device[: plan.num_reqs],
        block_tables=input_batch.block_tables.device[: plan.num_reqs],
        slot_mapping=input_batch.slot_mapping.device[: plan.num_tokens],
        max_query_len=max_query_len,
        max_seq_len=input_batch.max_model_len,
        query_lens_cpu=[1] * plan.num_reqs,
        seq_lens_cpu=[1] * plan.num_reqs,
    )


class GraphRunner:
    """What every kind of graph runs over: the model, its KV caches, the input buffers, the
    plans to capture (one per token count), and the runner's stream."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        input_batch: InputBatch,
        plans: list[StepPlan],
        stream: torch.cuda.Stream | None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.input_batch = input_batch
        self.plans = {plan.num_tokens: plan for plan in plans}
        self.stream = stream

    @property
    def sizes(self) -> list[int]:
        return sorted(self.plans)

    def run(self, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """The step's output; its inputs must be in the device buffers, padded to num_tokens,
        and meta is its own."""
        raise NotImplementedError

    def _log_capture(self, start: float) -> None:
        elapsed = time.perf_counter() - start
        logger.info(
            "captured %s for %d sizes in %.1f s", type(self).__name__, len(self.plans), elapsed
        )


class _WholeStepGraphs(GraphRunner):
    """One graph per plan of the whole forward pass; subclasses say what the pass computes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.input_batch.fill_padding(self.plans[max(self.plans)])
        pool = None
        with torch.cuda.stream(self.stream):
            for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
                plan, graph = self.plans[size], torch.cuda.CUDAGraph()
                self._forward(plan)  # warm-up: triton compiles and autotunes outside capture
                with torch.cuda.graph(
                    graph, pool=pool, stream=self.stream, capture_error_mode="thread_local"
                ):
                    self.outputs[size] = self._forward(plan)
                self.graphs[size] = graph
                pool = graph.pool()
        self.stream.synchronize()
        self._log_capture(start)

    def run(self, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """meta is unused: the graph reads the step's metadata from the device buffers."""
        self.graphs[num_tokens].replay()
        return self.outputs[num_tokens]

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        raise NotImplementedError

    def _hidden(self, plan: StepPlan, max_query_len: int) -> torch.Tensor:
        """The forward pass over the device buffers: no host data, no copies."""
        batch, n = self.input_batch, plan.num_tokens
        meta = _static_meta(batch, plan, max_query_len)
        return self.model(
            batch.input_ids.device[:n], batch.positions.device[:n], self.kv_caches, meta
        )


class DecodeGraphs(_WholeStepGraphs):
    """Pure-decode steps, per batch size: logits [size, vocab]."""

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        return self.model.compute_logits(self._hidden(plan, max_query_len=1))


class ShortStepGraphs(_WholeStepGraphs):
    """Steps with prompt tokens, attention included, per token count: hidden states
    [size, hidden]. A graph takes its plan's number of requests: the real ones, then requests
    of no tokens."""

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        return self._hidden(plan, max_query_len=plan.num_tokens)


class PiecewiseGraphs(GraphRunner):
    """Graph i (0 < i < L) is layer i-1 after its attention, then layer i up to its query;
    graph 0 starts at the embedding, graph L ends at the final norm. Between graphs, queries,
    attention outputs and the residual stream sit in fixed buffers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        shapes = self.model.piece_shapes
        rows = max(self.plans)
        like = {"dtype": shapes.dtype, "device": self.kv_caches[0].device}
        self.query = torch.zeros(rows, *shapes.query, **like)
        self.attn_out = torch.zeros(rows, *shapes.attn_out, **like)
        self.residual = torch.zeros(rows, shapes.hidden_size, **like)
        self.hidden = torch.zeros(rows, shapes.hidden_size, **like)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.input_batch.fill_padding(self.plans[max(self.plans)])
        pool = None
        with torch.cuda.stream(self.stream):
            for size in reversed(self.sizes):
                self.graphs[size] = []
                for piece in range(len(self.model.layers) + 1):
                    self._piece(piece, self.plans[size])  # warm-up: triton compiles outside capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(
                        graph, pool=pool, stream=self.stream, capture_error_mode="thread_local"
                    ):
                        self._piece(piece, self.plans[size])
                    self.graphs[size].append(graph)
                    pool = graph.pool()
            self._compile_attention(min(self.plans))
        self.stream.synchronize()
        self._log_capture(start)

    def run(self, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden]."""
        graphs = self.graphs[num_tokens]
        query, attn_out = self.query[:num_tokens], self.attn_out[:num_tokens]
        for graph, layer, kv_cache in zip(graphs, self.model.layers, self.kv_caches):
            graph.replay()
            layer.attend(query, kv_cache, meta, out=attn_out)
        graphs[-1].replay()
        return self.hidden[:num_tokens]

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
        layer = self.model.layers[0]
        layer.attend(self.query[:size], self.kv_caches[0], meta, out=self.attn_out[:size])

    def _piece(self, index: int, plan: StepPlan) -> None:
        batch, model, size = self.input_batch, self.model, plan.num_tokens
        layers = model.layers
        if index == 0:
            x, residual = model.embed(batch.input_ids.device[:size]), None
        else:
            layer = layers[index - 1]
            x, residual = layer.after_attention(self.attn_out[:size], self.residual[:size])
        if index == len(layers):
            self.hidden[:size].copy_(model.final_norm(x, residual))
            return
        meta = _static_meta(batch, plan, max_query_len=size)
        positions, kv_cache = batch.positions.device[:size], self.kv_caches[index]
        query, residual = layers[index].before_attention(positions, x, residual, kv_cache, meta)
        self.query[:size].copy_(query)
        if residual.data_ptr() != self.residual.data_ptr():
            self.residual[:size].copy_(residual)
