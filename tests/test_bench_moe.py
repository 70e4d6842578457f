"""The MoE benchmark's arithmetic and the tile sweep's choice, on CPU with a stand-in timer."""

from __future__ import annotations

import functools

import pytest
import torch

import bench.moe_tune as moe_tune
from bench.moe import MoeProblem, moe_traffic
from kernels.fused_moe import MoeTileConfig, fused_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QWEN3 = {"experts": 128, "top_k": 8, "inner": 768, "expert_weights": 3 * 2048 * 768}


def test_traffic_counts_each_pair_and_each_expert_once() -> None:
    traffic = moe_traffic(QWEN3, 2048, tokens=512, experts_read=128)
    assert traffic["flops"] == 2 * 512 * 8 * 3 * 2048 * 768
    assert traffic["least_bytes"] == (128 * 3 * 2048 * 768 + 2 * 512 * 2048) * 2
    assert traffic["intermediate_bytes"] == 2 * 4096 * (768 + 2048) * 2


def test_alignments_follow_each_experts_run() -> None:
    assert moe_tune.alignments(1, 8, 128) == [(16, 0)]  # one pair a tile
    heights = {m for m, _ in moe_tune.alignments(2048, 8, 128)}  # 128 rows an expert
    assert heights == {64, 128}
    for block_m, tail_m in moe_tune.alignments(8192, 2, 8):
        assert block_m >= 64 and (tail_m == 0 or block_m % tail_m == 0)


def tiny_problem(num_tokens: int) -> MoeProblem:
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden, inner, top_k = 4, 32, 16, 2
    w13 = torch.randn(num_experts, 2 * inner, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inner, generator=gen) / inner**0.5
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    weights = torch.full((num_tokens, top_k), 0.5)
    problem = x, w13, w2, weights, ids.to(torch.int32)
    return MoeProblem.make(*(t.to(DEVICE) for t in problem))


@pytest.mark.parametrize("num_tokens", [1, 40])
def test_sweep_takes_each_gemms_fastest_tiles_of_one_block_m(num_tokens, monkeypatch) -> None:
    # a stand-in timer: a GEMM's seconds fall with its block_n, so the widest tile of each
    # GEMM wins; every other phase costs the same
    def seconds(fn, *_) -> float:
        config = fn.args[-1] if isinstance(fn, functools.partial) else None
        return 1.0 / config.block_n if isinstance(config, MoeTileConfig) else 1.0

    monkeypatch.setattr(moe_tune, "graph_seconds", seconds)
    problem = tiny_problem(num_tokens)
    found = moe_tune.tune_size(problem, problem.num_experts)
    tiles = found["tiles"]
    options = moe_tune.alignments(num_tokens, 2, problem.num_experts)
    assert (tiles.up.block_m, tiles.tail_m) in options
    assert set(found["options"]) == {f"{m}+{t}" for m, t in options}
    widest_up = max(t[1] for t in moe_tune.UP_TILES if t[0] == tiles.up.block_m)
    widest_down = max(t[1] for t in moe_tune.DOWN_TILES if t[0] == tiles.up.block_m)
    assert (tiles.up.block_n, tiles.down.block_n) == (widest_up, widest_down)
    out = fused_experts(problem.x, problem.w13, problem.w2, problem.weights, problem.ids, tiles)
    assert out.shape == problem.x.shape
