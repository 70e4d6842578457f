"""The fp32 CPU GEMM as a decode step streams it: the default model's 30 layers of projections,
each layer's weights distinct (425 MB, so they come from DRAM as in the engine), run in order at
a few row counts; GFLOP/s of asyncllm's GEMM on panels (kernels/cpu_gemm.cpp, with gate/up's
SiLU-and-mul), its weights in fp32 and in bf16 (the bf16 mode without bf16 dot products),
against oneDNN's packed fp32 weights, the best of 5 passes each.

    python bench/cpu_gemm_chain.py --threads 2 --out bench/results/cpu_gemm_chain_zen3_avx2.json

One op in a loop keeps its weight in cache and hides how the next weights are prefetched;
bench/cpu_linear.py times that case.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.throughput import cpu_description
from kernels.cpu_gemm import (
    cpu_gemm,
    cpu_gemm_available,
    cpu_gemm_silu_and_mul,
    pack_cpu_gemm_weight,
)

LAYERS = 30
# SmolLM2-135M's qkv, o, gate_up and down projections: (N, K)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def ours(
    weights: list[list[torch.Tensor]], dtype: torch.dtype
) -> Callable[[list[torch.Tensor]], None]:
    panels = [[pack_cpu_gemm_weight(w.to(dtype)) for w in layer] for layer in weights]

    def run(xs: list[torch.Tensor]) -> None:
        for qkv, o, gate_up, down in panels:
            cpu_gemm(xs[0], qkv, None)
            cpu_gemm(xs[1], o, None)
            cpu_gemm_silu_and_mul(xs[2], gate_up)
            cpu_gemm(xs[3], down, None)

    return run


def onednn(weights: list[list[torch.Tensor]]) -> Callable[[list[torch.Tensor]], None]:
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in weights]

    def run(xs: list[torch.Tensor]) -> None:
        for layer in packed:
            for x, w in zip(xs, layer):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    return run


def gflops(run: Callable[[list[torch.Tensor]], None], rows: int) -> float:
    xs = [torch.randn(rows, k) for _, k in SHAPES]
    run(xs)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run(xs)
        best = min(best, time.perf_counter() - start)
    return LAYERS * sum(2 * rows * n * k for n, k in SHAPES) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="8,17,32,64", help="comma-separated row counts")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    variants = {"onednn_fp32": onednn(weights)}
    if cpu_gemm_available():
        variants = {
            "cpu_gemm_fp32": ours(weights, torch.float32),
            "cpu_gemm_bf16": ours(weights, torch.bfloat16),
        } | variants
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for m in rows:
        rates = {label: gflops(run, m) for label, run in variants.items()}
        results.append({"rows": m, "gflops_per_s": rates})
        print(m, {label: round(rate, 1) for label, rate in rates.items()}, flush=True)
    result = {
        "benchmark": "cpu_gemm_chain",
        "command": "python " + " ".join(sys.argv),
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "threads": args.threads,
        "layers": LAYERS,
        "timing": "wall clock, best of 5 passes over every layer",
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
