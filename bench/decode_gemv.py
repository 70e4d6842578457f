"""Batch-1 decode's projections on one GPU, timed as the decode step runs them: every layer's
weights (distinct tensors, so nothing stays in L2) in one CUDA graph, replayed.

    python bench/decode_gemv.py --out bench/results/decode_gemv_h200.json

Sections: each GEMM shape alone for a sweep of GEMV tile configs, against cuBLAS (F.linear);
then one layer's chain of projections with the norms and activation between them, unfused
(separate norm, GEMM and activation launches; cuBLAS or GEMV GEMMs) against the fused GEMV
kernels.
GB/s counts the weight bytes, against a copy measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

# run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow kernels
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (  # noqa: E402
    fused_add_rms_norm,
    gemv,
    rms_norm_gemv,
    silu_and_mul,
    silu_and_mul_gemv,
)
from kernels.gemv import GemvConfig, choose_gemv_config  # noqa: E402

DTYPE = torch.bfloat16
# Qwen3-0.6B: 28 layers, hidden 1024, q 2048, q + k + v 4096, intermediate 3072, vocab 151936
LAYERS, HIDDEN, Q_SIZE, QKV_SIZE, INTER, VOCAB = 28, 1024, 2048, 4096, 3072, 151936
SHAPES = {  # GEMM: (N, K)
    "qkv_proj": (QKV_SIZE, HIDDEN),
    "o_proj": (HIDDEN, Q_SIZE),
    "gate_up_proj": (2 * INTER, HIDDEN),
    "down_proj": (HIDDEN, INTER),
}
SWEEP = [
    GemvConfig(block_n, block_k, warps)
    for block_n, block_k, warps in itertools.product(
        (1, 2, 4, 8, 16), (256, 512, 1024, 2048, 4096), (4, 8)
    )
    if 1024 <= block_n * block_k <= 16384
]


def graph_us(fn: Callable[[], object], replays: int = 50) -> float:
    """Microseconds per replay of a CUDA graph of fn (captured after a warm-up run)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / replays


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_us(lambda: dst.copy_(src), replays=20) / 1e3


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DTYPE) * 0.02


def sweep_shape(name: str, n: int, k: int, copy: float) -> dict:
    weights = [rand(n, k) for _ in range(LAYERS)]
    x = rand(1, k)

    def per_gemm_us(gemm: Callable[[torch.Tensor], object]) -> float:
        return graph_us(lambda: [gemm(w) for w in weights]) / LAYERS

    rows = []
    for config in SWEEP:
        us = per_gemm_us(lambda w, c=config: gemv(x, w, config=c))
        rows.append({"config": vars(config), "us": us, "gbps": n * k * 2 / us / 1e3})
    best = min(rows, key=lambda r: r["us"])
    chosen = choose_gemv_config(n, k)
    chosen_us = per_gemm_us(lambda w: gemv(x, w, config=chosen))
    cublas_us = per_gemm_us(lambda w: F.linear(x, w))
    return {
        "gemm": name,
        "n": n,
        "k": k,
        "chosen": {
            "config": vars(chosen),
            "us": chosen_us,
            "pct_of_copy": pct(n, k, chosen_us, copy),
        },
        "best": dict(best, pct_of_copy=pct(n, k, best["us"], copy)),
        "cublas_us": cublas_us,
        "sweep": rows,
    }


def pct(n: int, k: int, us: float, copy: float) -> float:
    return 100 * n * k * 2 / us / 1e3 / copy


def layer_chain() -> dict:
    """One decode layer's projections with what runs between them, for all layers."""
    layers = [
        {name: rand(n, k) for name, (n, k) in SHAPES.items()}
        | {"norm1": rand(HIDDEN) + 1, "norm2": rand(HIDDEN) + 1}
        for _ in range(LAYERS)
    ]
    x0, attn = rand(1, HIDDEN), rand(1, Q_SIZE)

    def unfused(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        x, residual = x0.clone(), x0.clone()
        for w in layers:
            x, residual = fused_add_rms_norm(x, residual, w["norm1"], 1e-6)
            linear(x, w["qkv_proj"])
            x, residual = fused_add_rms_norm(linear(attn, w["o_proj"]), residual, w["norm2"], 1e-6)
            x = linear(silu_and_mul(linear(x, w["gate_up_proj"])), w["down_proj"])

    def fused() -> None:
        x, residual = x0, x0
        for w in layers:
            rms_norm_gemv(x, residual, w["norm1"], 1e-6, w["qkv_proj"])
            gate_up, residual = rms_norm_gemv(
                gemv(attn, w["o_proj"]), residual, w["norm2"], 1e-6, w["gate_up_proj"]
            )
            x = silu_and_mul_gemv(gate_up, w["down_proj"])

    weight_bytes = sum(n * k * 2 for n, k in SHAPES.values())
    return {
        "launches_per_layer": {"unfused": 7, "fused": 4},
        "unfused_cublas_us_per_layer": graph_us(lambda: unfused(F.linear)) / LAYERS,
        "unfused_gemv_us_per_layer": graph_us(lambda: unfused(gemv)) / LAYERS,
        "fused_gemv_us_per_layer": graph_us(fused) / LAYERS,
        "weight_bytes_per_layer": weight_bytes,
        "floor_us_per_layer_at_copy": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    copy = copy_gbps()
    shapes = dict(SHAPES, lm_head=(VOCAB, HIDDEN))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": copy,
        "gemms": [sweep_shape(name, n, k, copy) for name, (n, k) in shapes.items()],
        "layer_chain": layer_chain(),
    }
    chain = result["layer_chain"]
    chain["floor_us_per_layer_at_copy"] = chain["weight_bytes_per_layer"] / copy / 1e3
    for g in result["gemms"]:
        print(
            f"{g['gemm']:13s} chosen {g['chosen']['us']:6.2f} us ({g['chosen']['pct_of_copy']:.0f}%) "
            f"best {g['best']['us']:6.2f} us {g['best']['config']} cuBLAS {g['cublas_us']:6.2f} us"
        )
    print(
        f"layer: unfused cuBLAS {chain['unfused_cublas_us_per_layer']:.1f} us, unfused GEMV "
        f"{chain['unfused_gemv_us_per_layer']:.1f} us, fused "
        f"{chain['fused_gemv_us_per_layer']:.1f} us, floor {chain['floor_us_per_layer_at_copy']:.1f} us"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
