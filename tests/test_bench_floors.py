"""bench/throughput.py's floors: the CPU roofline floor is the compute floor where bytes are
free and the decode steps' bytes alone where FLOPs are free."""

from __future__ import annotations

import math

import transformers

from bench.throughput import (
    cpu_floor_seconds,
    cpu_roofline_floor_seconds,
    gpu_floor_seconds,
    make_workload,
    prefill_flops,
    token_flops,
)

CONFIG = transformers.LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
)
WORKLOAD = [([1] * 5, 3), ([1] * 9, 7), ([1] * 2, 1)]


def test_roofline_floor_is_the_compute_floor_where_bytes_are_free() -> None:
    roofline = cpu_roofline_floor_seconds(CONFIG, WORKLOAD, 1e9, math.inf)
    assert math.isclose(roofline, cpu_floor_seconds(CONFIG, WORKLOAD, 1e9))


def test_roofline_floor_is_the_steps_bytes_where_flops_are_free() -> None:
    roofline = cpu_roofline_floor_seconds(CONFIG, WORKLOAD, math.inf, 1e9)
    assert math.isclose(roofline, gpu_floor_seconds(CONFIG, WORKLOAD, math.inf, 1e9, 4))


def test_roofline_floor_is_at_least_either_bound() -> None:
    roofline = cpu_roofline_floor_seconds(CONFIG, WORKLOAD, 1e9, 1e8)
    assert roofline >= cpu_floor_seconds(CONFIG, WORKLOAD, 1e9)
    assert roofline >= gpu_floor_seconds(CONFIG, WORKLOAD, math.inf, 1e8, 4)
    assert roofline < cpu_floor_seconds(CONFIG, WORKLOAD, 1e9) + gpu_floor_seconds(
        CONFIG, WORKLOAD, math.inf, 1e8, 4
    )


def test_prefill_flops_sum_every_prompt_position() -> None:
    by_position = sum(token_flops(CONFIG, t) for p, _ in WORKLOAD for t in range(len(p)))
    assert prefill_flops(CONFIG, WORKLOAD) == by_position


def test_outputs_take_their_own_range() -> None:
    default = make_workload(50, 10, 20, vocab=1000, seed=3)
    assert default == make_workload(50, 10, 20, vocab=1000, seed=3, output_range=(10, 20))
    workload = make_workload(50, 10, 20, vocab=1000, seed=3, output_range=(1, 4))
    assert all(10 <= len(p) <= 20 and 1 <= o <= 4 for p, o in workload)


def test_quant_offline_floors_agree_with_the_throughput_floor_and_shrink_with_fp8() -> None:
    """bench/quant.py's bf16 floor is bench/throughput.py's on the same workload; FP8 weights at
    the same GEMM rate cut only the decode steps' weight bytes, an FP8 cache their KV bytes,
    and a faster FP8 rate the prompts' projections."""
    from asyncllm.models.shapes import SHAPES
    from bench.quant import SHAPE, offline_floor_seconds

    config = transformers.LlamaConfig(**SHAPES[SHAPE])
    workload = make_workload(256, 100, 1024, SHAPES[SHAPE]["vocab_size"], 0)
    same = {"bf16": 7e14, "fp8": 7e14}
    bf16 = offline_floor_seconds("bf16", same, 4e12)
    assert math.isclose(bf16, gpu_floor_seconds(config, workload, 7e14, 4e12, 2))
    fp8, fp8_all = (offline_floor_seconds(m, same, 4e12) for m in ("fp8", "fp8-all"))
    assert fp8_all < fp8 < bf16
    assert offline_floor_seconds("fp8", {"bf16": 7e14, "fp8": 14e14}, 4e12) < fp8
    assert math.isclose(offline_floor_seconds("fp8-kv", same, 4e12) - fp8_all, bf16 - fp8)
