"""MoE and MLA benchmarks on one GPU, each against a floor measured in the same run.

    python bench/moe.py offline --shape mixtral-8x7b --out bench/results/moe_offline_mixtral_h200.json
    python bench/moe.py prompts --shape deepseek-v2-lite --out bench/results/moe_prompts_deepseek-v2-lite_h200.json
    python bench/moe.py kernels --shape qwen3-30b-a3b --out bench/results/moe_kernels_qwen3_h200.json

(The fused MoE's tile sweep is bench/moe_tune.py.)

offline: the nano-vllm workload (256 requests, prompt and output lengths uniform in 100-1024,
random ids, ignore_eos) on a shape's dummy bf16 weights. Floor: prefill FLOPs (2 per active
weight: attention, the top-k and shared experts, the lm_head; plus attention over the context)
at the matmul rate, and per decode step the bytes it must read at the copy bandwidth: the
attention and dense weights, every expert that the step's tokens are expected to route to under
uniform routing (E * (1 - (1 - k/E)^B) per layer for B tokens) and the live KV (GQA: keys and
values per head; MLA: one latent + rope key per token). Then batch-1 decode against its
weight-bandwidth floor (the weights one token reads, its k experts per layer).

prompts: the offline workload's prompts alone (one output token each) against the floor's
prefill part.

kernels: the fused MoE (CUDA-graph timed: the routing alignment and both grouped GEMMs) at
decode sizes against the copy bandwidth over the experts it reads, at prefill sizes against the
bf16 matmul rate, and at every size against its roofline: the larger of its FLOPs at the matmul
rate and its least bytes (the experts read, x, the output) at the copy bandwidth. Each size's
time is split into its phases, each replayed alone: the routing (torch ops and the kernel), the
alignment, the gate/up GEMM, the down GEMM, the top-k sum. At one pair a tile (a token or
two) also the gate/up and the summed down as grouped GEMVs (kernels/moe_gemv.py), each over a
few launch settings, and the whole fused MoE with either or both of them (default settings)
in place of the GEMMs (`gemv`). Then
the paged MLA decode kernel (DeepSeek shapes) against the copy bandwidth over the latent cache
it reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
import triton
from triton.testing import do_bench_cudagraph

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm.layers.fused_moe import RoutingConfig, select_experts  # noqa: E402
from asyncllm.layers.fused_moe.routing import torch_select_experts  # noqa: E402
from asyncllm.models.shapes import write_shape  # noqa: E402
from bench.throughput import (  # noqa: E402
    copy_bandwidth,
    make_workload,
    matmul_rate,
    run_asyncllm,
)
from kernels._common import next_pow2  # noqa: E402
from kernels.fused_moe import (  # noqa: E402
    ExpertAlignment,
    MoeTileConfig,
    MoeTiles,
    Rows,
    align_for,
    fused_experts,
    grouped_gemm,
    sorted_rows,
    tile_config,
    tiles_to_json,
    top_k_sum,
)
from kernels.mla_decode import paged_mla_decode  # noqa: E402
from kernels.moe_gemv import (  # noqa: E402
    MoeGemvConfig,
    default_moe_gemv_config,
    summed_down_gemv,
    up_gemv,
)
from kernels.moe_routing import route_top_k  # noqa: E402

MOE_SHAPES = ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite"]
DECODE_SIZES = [1, 2, 4, 8, 16, 32, 64]
PREFILL_SIZES = [512, 2048, 8192]
# the GEMVs' settings timed at one pair a tile: (block_n, block_k, num_warps), block_k at
# most the next power of two of K
UP_GEMV_SETTINGS = [(2, 2048, 4), (4, 1024, 4), (4, 2048, 8), (8, 1024, 8), (8, 2048, 8)]
DOWN_GEMV_SETTINGS = [(1, 1024, 4), (2, 1024, 4), (4, 1024, 8), (2, 2048, 8), (8, 2048, 8)]
DTYPE = torch.bfloat16
MAX_BLOCK_M = 128  # the tallest row tile bench/moe_tune.py sweeps
BYTES = 2


# ---- the shapes' arithmetic ----


def moe_geometry(c: transformers.PretrainedConfig) -> dict:
    """Experts per layer, top-k, one expert's weights, and which layers are MoE."""
    if c.model_type == "mixtral":
        experts, inner, moe_layers, shared = (
            c.num_local_experts,
            c.intermediate_size,
            c.num_hidden_layers,
            0,
        )
    elif c.model_type == "qwen3_moe":
        experts, inner, shared = c.num_experts, c.moe_intermediate_size, 0
        moe_layers = c.num_hidden_layers - len(c.mlp_only_layers or [])
    else:
        experts, inner = c.n_routed_experts, c.moe_intermediate_size
        shared = inner * (c.n_shared_experts or 0)
        moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    return {
        "experts": experts,
        "top_k": c.num_experts_per_tok,
        "inner": inner,
        "expert_weights": 3 * c.hidden_size * inner,
        "moe_layers": moe_layers,
        "dense_layers": c.num_hidden_layers - moe_layers,
        "shared_inner": shared,
    }


def attention_weights(c: transformers.PretrainedConfig) -> int:
    h, heads = c.hidden_size, c.num_attention_heads
    if c.model_type == "deepseek_v2":
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        q = h * heads * qk if c.q_lora_rank is None else c.q_lora_rank * (h + heads * qk)
        kv = h * (c.kv_lora_rank + c.qk_rope_head_dim)
        kv += c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        return q + kv + heads * c.v_head_dim * h
    kv_heads = c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    return h * head_dim * (2 * heads + 2 * kv_heads)


def always_read_weights(c: transformers.PretrainedConfig) -> int:
    """Weights every step reads whatever the routing: attention, dense MLPs, routers, shared
    experts, the lm_head (embedding lookups excluded)."""
    g = moe_geometry(c)
    h = c.hidden_size
    dense = g["dense_layers"] * 3 * h * c.intermediate_size
    per_moe_layer = h * g["experts"] + 3 * h * g["shared_inner"]
    return (
        c.num_hidden_layers * attention_weights(c)
        + dense
        + g["moe_layers"] * per_moe_layer
        + h * c.vocab_size
    )


def expected_experts(c: transformers.PretrainedConfig, tokens: int) -> float:
    """Distinct experts per MoE layer that `tokens` tokens routed uniformly are expected to hit."""
    g = moe_geometry(c)
    return g["experts"] * (1 - (1 - g["top_k"] / g["experts"]) ** tokens)


def kv_bytes_per_token(c: transformers.PretrainedConfig) -> int:
    if c.model_type == "deepseek_v2":
        return c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * BYTES
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * BYTES


def attention_flops_per_position(c: transformers.PretrainedConfig) -> int:
    """FLOPs of one query against one key, all layers and heads (QK^T and PV)."""
    heads = c.num_attention_heads
    if c.model_type == "deepseek_v2":
        per_layer = 2 * heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    else:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        per_layer = 4 * heads * head_dim
    return c.num_hidden_layers * per_layer


def active_weights(c: transformers.PretrainedConfig) -> int:
    g = moe_geometry(c)
    return always_read_weights(c) + g["moe_layers"] * g["top_k"] * g["expert_weights"]


def offline_floor_seconds(c, workload, matmul: float, copy: float) -> dict:
    g = moe_geometry(c)
    attention = attention_flops_per_position(c)
    prefill_flops = sum(
        2 * active_weights(c) * len(p) + attention * len(p) * (len(p) + 1) / 2 for p, _ in workload
    )
    prefill = prefill_flops / matmul
    decode = 0.0
    for step in range(max(o for _, o in workload)):
        live = [len(p) + step for p, o in workload if o > step]
        experts = g["moe_layers"] * expected_experts(c, len(live)) * g["expert_weights"]
        decode += (
            (always_read_weights(c) + experts) * BYTES + kv_bytes_per_token(c) * sum(live)
        ) / copy
    return {"prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode}


# ---- runs ----


def shape_config(shape: str) -> tuple[Path, transformers.PretrainedConfig]:
    path = write_shape(shape, Path(tempfile.mkdtemp(prefix=f"{shape}-")))
    return path, transformers.AutoConfig.from_pretrained(path)


def offline(args) -> dict:
    path, config = shape_config(args.shape)
    workload = make_workload(256, 100, 1024, config.vocab_size, 0)
    device = torch.device("cuda")
    rates = {
        "matmul_flops_per_s": matmul_rate(device, DTYPE),
        "copy_bytes_per_s": copy_bandwidth(device),
    }
    floor = offline_floor_seconds(
        config, workload, rates["matmul_flops_per_s"], rates["copy_bytes_per_s"]
    )
    output_tokens = sum(o for _, o in workload)
    run_args = argparse.Namespace(
        load_format="dummy",
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        long_prefill_token_threshold=0,
        enforce_eager=False,
        async_scheduling=None,
        profile_steps=args.phases,
        single_stream=True,
        profile_batch1_steps=args.profile_batch1_steps,
        tensor_parallel_size=1,
        quantization=None,
        dtype="auto",
        disable_tqdm=True,
    )
    ours = run_asyncllm(str(path), workload, run_args)
    floor_tokens_per_s = output_tokens / floor["total_s"]
    batch1_bytes = active_weights(config) * BYTES
    result = {
        "floor": floor,
        "floor_output_tokens_per_s": floor_tokens_per_s,
        "asyncllm": ours,
        "fraction_of_floor": ours["output_tokens_per_s"] / floor_tokens_per_s,
        "single_stream_floor_tokens_per_s": rates["copy_bytes_per_s"] / batch1_bytes,
        "single_stream_fraction_of_floor": ours["single_stream"]["decode_tokens_per_s"]
        * batch1_bytes
        / rates["copy_bytes_per_s"],
        "workload": {
            "num_requests": 256,
            "min_len": 100,
            "max_len": 1024,
            "prompt_tokens": sum(len(p) for p, _ in workload),
            "output_tokens": output_tokens,
        },
        "weights": {
            "active_per_token": active_weights(config),
            "always_read": always_read_weights(config),
        },
    }
    print(
        f"{args.shape}: {ours['output_tokens_per_s']:.0f} output tokens/s, floor {floor_tokens_per_s:.0f} "
        f"({result['fraction_of_floor']:.0%}); batch 1 {ours['single_stream']['decode_tokens_per_s']:.1f} "
        f"tokens/s, floor {result['single_stream_floor_tokens_per_s']:.1f} "
        f"({result['single_stream_fraction_of_floor']:.0%})"
    )
    if "seconds_by_phase" in ours:
        print("seconds by phase:", {k: round(v, 2) for k, v in ours["seconds_by_phase"].items()})
    if "batch1_profile" in ours:
        profile = ours["batch1_profile"]
        print(
            f"batch-1 step: {profile['gpu_kernel_launches_per_step']:.0f} kernels, "
            f"{profile['gpu_kernel_ms_per_step']:.2f} ms of kernels, "
            f"{profile['wall_ms_per_step']:.2f} ms wall (profiled)"
        )
    return {"rates": rates, **result}


def prompts(args) -> dict:
    """The offline workload's prompts alone (max_tokens 1), three passes on one engine (the
    first also compiles) without prefix caching, against the floor's prefill part."""
    from asyncllm import LLM, SamplingParams

    path, config = shape_config(args.shape)
    workload = make_workload(256, 100, 1024, config.vocab_size, 0)
    device = torch.device("cuda")
    matmul = matmul_rate(device, DTYPE)
    floor = offline_floor_seconds(config, workload, matmul, copy_bandwidth(device))["prefill_s"]
    llm = LLM(
        model=str(path),
        load_format="dummy",
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,  # each pass computes the same prompts again
    )
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p, _ in workload]
    walls = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(requests, one_token, use_tqdm=False)
        walls.append(time.perf_counter() - start)
    best = min(walls[1:])
    print(f"{args.shape} prompts alone: {walls} s, floor {floor:.3f} s ({floor / best:.0%})")
    return {
        "matmul_flops_per_s": matmul,
        "prefill_floor_s": floor,
        "wall_s": walls,
        "fraction_of_floor": floor / best,
        "prompt_tokens": sum(len(p) for p, _ in workload),
    }


def expert_weights(config) -> tuple[torch.Tensor, torch.Tensor, RoutingConfig]:
    g = moe_geometry(config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(
        g["experts"], 2 * g["inner"], config.hidden_size, generator=gen, device="cuda", dtype=DTYPE
    )
    w2 = torch.randn(
        g["experts"], config.hidden_size, g["inner"], generator=gen, device="cuda", dtype=DTYPE
    )
    return w13 * 0.02, w2 * 0.02, RoutingConfig(top_k=g["top_k"])


def routed(config, tokens: int, routing: RoutingConfig) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, config.hidden_size, generator=gen, device="cuda", dtype=DTYPE)
    logits = torch.randn(tokens, moe_geometry(config)["experts"], generator=gen, device="cuda")
    return (x, *select_experts(logits, routing))


def time_call(fn, *args, rep: int = 50) -> float:
    """Seconds per call of fn(*args), replayed in a CUDA graph (the way the engine runs it)."""
    fn(*args)  # compiles outside the timing (the graph capture would otherwise compile)
    return do_bench_cudagraph(lambda: fn(*args), rep=rep) / 1e3


def graph_seconds(fn, rep_ms: float = 3.0, replays: int = 3) -> float:
    """Seconds per call of fn, the least of a few replays of a CUDA graph of about rep_ms of
    calls: do_bench_cudagraph's method in a fifth of its time, for sweeps of many settings."""
    fn()
    once = _graph_of(fn, 1)
    estimate = max(_replay_ms(once) for _ in range(2))
    repeats = max(1, min(200, int(rep_ms / max(estimate, 1e-3))))
    many = _graph_of(fn, repeats)
    return min(_replay_ms(many) for _ in range(replays)) / repeats / 1e3


def _graph_of(fn, repeats: int) -> torch.cuda.CUDAGraph:
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@dataclasses.dataclass
class MoeProblem:
    """One shape at one batch size with fixed buffers, so that graphs can replay each phase."""

    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    activated: torch.Tensor  # [pairs, I]: at one pair a tile
    sorted_activated: torch.Tensor  # [sorted rows, I]: grouped by expert, as fused_experts
    out: torch.Tensor  # [pairs, H]: each pair's row
    summed: torch.Tensor  # [T, H]: down_gemv's

    @classmethod
    def make(cls, x, w13, w2, weights, ids) -> MoeProblem:
        pairs, inner, hidden = ids.numel(), w2.shape[2], w2.shape[1]
        activated = torch.randn(pairs, inner, device=x.device, dtype=x.dtype)
        # room for the sorted rows of every alignment swept
        rows = sorted_rows(pairs, w13.shape[0], MAX_BLOCK_M)
        sorted_activated = torch.randn(rows, inner, device=x.device, dtype=x.dtype)
        out = torch.empty(pairs, hidden, device=x.device, dtype=x.dtype)
        summed = torch.empty(x.shape[0], hidden, device=x.device, dtype=x.dtype)
        return cls(x, w13, w2, weights, ids, activated, sorted_activated, out, summed)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def align(self, block_m: int, tail_m: int = 0) -> ExpertAlignment:
        return align_for(self.ids, block_m, self.num_experts, tail_m)

    def up(self, alignment: ExpertAlignment, config: MoeTileConfig) -> None:
        top_k, inner = self.ids.shape[1], self.w2.shape[2]
        grouped = not alignment.one_pair_tiles
        assert alignment.sorted_pair_ids.numel() <= self.sorted_activated.shape[0], "MAX_BLOCK_M"
        out = self.sorted_activated if grouped else self.activated
        rows = Rows(sorted_out=grouped)
        grouped_gemm(self.x, self.w13, out, alignment, None, top_k, inner, config, rows)

    def down(self, alignment: ExpertAlignment, config: MoeTileConfig) -> None:
        weights, hidden = self.weights.flatten(), self.w2.shape[1]
        grouped = not alignment.one_pair_tiles
        a = self.sorted_activated if grouped else self.activated
        rows = Rows(sorted_a=grouped)
        grouped_gemm(a, self.w2, self.out, alignment, weights, 1, hidden, config, rows)

    def up_gemv(self, config: MoeGemvConfig | None = None) -> None:
        up_gemv(self.x, self.w13, self.ids.flatten(), self.activated, config)

    def down_gemv(self, config: MoeGemvConfig | None = None) -> None:
        """down with the top-k sum in it, as grouped GEMVs (one pair a tile only)."""
        ids, weights = self.ids.flatten(), self.weights.flatten()
        summed_down_gemv(self.activated, self.w2, self.summed, ids, weights, config)

    def top_k_sum(self) -> torch.Tensor:
        return top_k_sum(self.out.view(*self.ids.shape, -1))

    def whole(self, tiles: MoeTiles | None = None) -> torch.Tensor:
        return fused_experts(self.x, self.w13, self.w2, self.weights, self.ids, tiles)


def moe_traffic(g: dict, hidden: int, tokens: int, experts_read: int) -> dict:
    """FLOPs and bytes of the fused MoE at one size: the least bytes (each expert read once, x
    read and the output written once) and what the two-GEMM form moves besides (the activated
    rows written and read back, each pair's output written and read back by the top-k sum)."""
    pairs = tokens * g["top_k"]
    least = (experts_read * g["expert_weights"] + 2 * tokens * hidden) * BYTES
    between = 2 * pairs * (g["inner"] + hidden) * BYTES
    return {
        "flops": 2 * pairs * g["expert_weights"],
        "least_bytes": least,
        "intermediate_bytes": between,
    }


def phase_seconds(problem: MoeProblem, routing: RoutingConfig, logits, tiles: MoeTiles) -> dict:
    """Each phase of one call replayed alone; with the kernel's routing, the sum of the last
    four is what a layer's experts cost (one pair a tile: no alignment launches, the GEMVs
    where the tiles take them; with down's, no top-k sum)."""
    alignment = problem.align(tiles.up.block_m, tiles.tail_m)
    sigmoid = routing.scoring == "sigmoid"
    one_pair = alignment.one_pair_tiles
    up_gemv, summed = one_pair and tiles.up_gemv, one_pair and tiles.down_gemv
    return {
        "routing_torch_s": graph_seconds(lambda: torch_select_experts(logits, routing)),
        "routing_kernel_s": graph_seconds(
            lambda: route_top_k(logits, routing.top_k, sigmoid, routing.renormalize)
        ),
        "align_s": 0.0
        if one_pair
        else graph_seconds(lambda: problem.align(tiles.up.block_m, tiles.tail_m)),
        "up_s": graph_seconds(
            problem.up_gemv if up_gemv else lambda: problem.up(alignment, tiles.up)
        ),
        "down_s": graph_seconds(
            problem.down_gemv if summed else lambda: problem.down(alignment, tiles.down)
        ),
        "top_k_sum_s": 0.0 if summed else graph_seconds(problem.top_k_sum),
    }


def moe_kernel(config, rates: dict) -> list[dict]:
    w13, w2, routing = expert_weights(config)
    g = moe_geometry(config)
    matmul, copy = rates["matmul_flops_per_s"], rates["copy_bytes_per_s"]
    rows = []
    for tokens in DECODE_SIZES + PREFILL_SIZES:
        x, weights, ids = routed(config, tokens, routing)
        problem = MoeProblem.make(x, w13, w2, weights, ids)
        tiles = tile_config(
            g["experts"], g["inner"], config.hidden_size, tokens, x.device, g["top_k"]
        )
        seconds = time_call(problem.whole, rep=20)
        experts_read = int(torch.unique(ids).numel())
        traffic = moe_traffic(g, config.hidden_size, tokens, experts_read)
        roofline = max(traffic["flops"] / matmul, traffic["least_bytes"] / copy)
        row = {"tokens": tokens, "seconds": seconds, "experts_read": experts_read, **traffic}
        row["roofline_seconds"] = roofline
        row["fraction_of_roofline"] = roofline / seconds
        weight_bytes = experts_read * g["expert_weights"] * BYTES
        if tokens in DECODE_SIZES:
            row["fraction_of_copy_bandwidth"] = weight_bytes / seconds / copy
        else:
            row["fraction_of_matmul_rate"] = traffic["flops"] / seconds / matmul
        logits = torch.randn(tokens, g["experts"], device=x.device, dtype=DTYPE)
        row["phases"] = phase_seconds(problem, routing, logits, tiles)
        if problem.align(tiles.up.block_m).one_pair_tiles:
            row["gemv"] = gemv_timings(problem, tiles, weight_bytes, copy)
        row["tiles"] = tiles_to_json(tiles)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tiles"}))
    return rows


def gemv_timings(problem: MoeProblem, tiles: MoeTiles, weight_bytes: int, copy: float) -> dict:
    """Each GEMV alone under each of its settings (checked against the GEMMs' output), and
    the whole fused MoE with either or both (default settings) in place of the GEMMs."""
    alignment = problem.align(tiles.up.block_m)
    problem.up(alignment, tiles.up)
    problem.down(alignment, tiles.down)
    up_expected, down_expected = problem.activated.clone(), problem.top_k_sum()
    up_k, down_k = problem.x.shape[1], problem.w2.shape[2]
    up_s = _gemv_settings(problem.up_gemv, UP_GEMV_SETTINGS, up_k, problem.activated, up_expected)
    down_s = _gemv_settings(
        problem.down_gemv, DOWN_GEMV_SETTINGS, down_k, problem.summed, down_expected
    )
    variants = {"up_gemv": (True, False), "down_gemv": (False, True), "both": (True, True)}
    whole = {
        name: time_call(problem.whole, dataclasses.replace(tiles, up_gemv=u, down_gemv=d), rep=20)
        for name, (u, d) in variants.items()
    }
    return {
        "up_default": dataclasses.asdict(default_moe_gemv_config(up_k)),
        "up_s_by_config": up_s,
        "down_default": dataclasses.asdict(default_moe_gemv_config(down_k)),
        "down_s_by_config": down_s,
        "whole_seconds": whole,
        "whole_fraction_of_copy_bandwidth": {n: weight_bytes / s / copy for n, s in whole.items()},
    }


def _gemv_settings(gemv, settings, k: int, out: torch.Tensor, expected: torch.Tensor) -> dict:
    """gemv(config) timed under each (block_n, block_k, num_warps), its output checked."""
    times = {}
    for block_n, block_k, num_warps in settings:
        config = MoeGemvConfig(block_n, min(block_k, next_pow2(k)), num_warps)
        gemv(config)
        error = (out.float() - expected.float()).norm() / expected.float().norm()
        assert error < 2e-2, (config, error.item())
        times[str(dataclasses.astuple(config))] = graph_seconds(lambda c=config: gemv(c))
    return times


def mla_kernel(config, rates: dict) -> list[dict]:
    rank, rope, heads = config.kv_lora_rank, config.qk_rope_head_dim, config.num_attention_heads
    block_size, rows = 16, []
    for batch, context in [(1, 4096), (8, 4096), (32, 2048), (64, 1024), (128, 1024), (256, 512)]:
        blocks_per_seq = context // block_size
        cache = torch.randn(
            1, batch * blocks_per_seq, block_size, 1, rank + rope, device="cuda", dtype=DTYPE
        )
        tables = torch.randperm(batch * blocks_per_seq, device="cuda", dtype=torch.int32).view(
            batch, -1
        )
        query = torch.randn(batch, heads, rank + rope, device="cuda", dtype=DTYPE)
        request = torch.arange(batch, device="cuda", dtype=torch.int32)
        length = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        scale = (config.qk_nope_head_dim + rope) ** -0.5
        seconds = time_call(paged_mla_decode, query, cache, tables, request, length, scale, rank)
        read = batch * context * (rank + rope) * BYTES + 2 * query.numel() * BYTES
        row = {
            "batch": batch,
            "context": context,
            "seconds": seconds,
            "fraction_of_copy_bandwidth": read / seconds / rates["copy_bytes_per_s"],
        }
        rows.append(row)
        print(json.dumps(row))
    return rows


def kernels_run(args) -> dict:
    _, config = shape_config(args.shape)
    device = torch.device("cuda")
    rates = {
        "matmul_flops_per_s": matmul_rate(device, DTYPE),
        "copy_bytes_per_s": copy_bandwidth(device),
    }
    result = {"rates": rates, "fused_moe": moe_kernel(config, rates)}
    if config.model_type == "deepseek_v2" and not args.no_mla:
        result["mla_decode"] = mla_kernel(config, rates)
    return result


def result_header(benchmark: str) -> dict:
    """What every result file of these benchmarks opens with: the run, the device, versions."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["offline", "prompts", "kernels"])
    parser.add_argument("--shape", choices=MOE_SHAPES, required=True)
    parser.add_argument("--no-mla", action="store_true", help="kernels: the fused MoE only")
    parser.add_argument(
        "--phases", action="store_true", help="offline: time the step's host phases and waits"
    )
    parser.add_argument(
        "--profile-batch1-steps",
        type=int,
        default=0,
        help="offline: then profile this many batch-1 decode steps (kernels and launches a step)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()
    run = {"offline": offline, "prompts": prompts, "kernels": kernels_run}[args.what]
    result = {**result_header(f"moe_{args.what}"), "shape": args.shape, **run(args)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
