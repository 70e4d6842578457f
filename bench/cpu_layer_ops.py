"""The C++ layer ops of kernels/cpu_layer_ops.cpp against the torch code they replace on CPU, on
the default model's shapes (hidden 576, 9 query and 3 KV heads of 64), one thread, in thread CPU
time: the minimum over interleaved rounds (the machine is shared; see bench/cpu_linear.py).

    python bench/cpu_layer_ops.py --out bench/results/cpu_layer_ops_zen5_loaded.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm.layers.norm import fused_add_rms_norm
from asyncllm.layers.rotary import RotaryEmbedding, apply_rotary
from bench.throughput import cpu_description
from kernels.cpu_layer_ops import (
    cpu_layer_ops_available,
    fused_add_rms_norm_cpu,
    rotary_embedding_cpu,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 576, 9, 3, 64


def microseconds(fn, inner: int = 200) -> float:
    fn()
    start = time.thread_time()
    for _ in range(inner):
        fn()
    return (time.thread_time() - start) / inner * 1e6


def variants(rows: int) -> dict:
    x, residual, weight = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN), torch.rand(HIDDEN)
    rotary = RotaryEmbedding(HEAD_DIM, 8192, 1e5, None)
    cache, positions = rotary.cos_sin_cache, torch.randint(0, 8192, (rows,))
    qkv = torch.randn(rows, HEADS + 2 * KV_HEADS, HEAD_DIM)
    q, k, _ = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    return {
        "fused_add_rms_norm torch": lambda: fused_add_rms_norm(x, residual, weight, 1e-5),
        "fused_add_rms_norm C++": lambda: fused_add_rms_norm_cpu(x, residual, weight, 1e-5),
        "rotary q and k torch": lambda: (
            apply_rotary(q, positions, cache),
            apply_rotary(k, positions, cache),
        ),
        "rotary q and k C++": lambda: rotary_embedding_cpu(positions, q, k, cache),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="17,256", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    assert cpu_layer_ops_available()
    timings = []
    for rows in (int(r) for r in args.rows.split(",")):
        calls = variants(rows)
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(args.rounds):
            for label, call in calls.items():
                best[label] = min(best[label], microseconds(call))
        timings.append({"rows": rows, "microseconds": best})
    result = {
        "benchmark": "cpu_layer_ops",
        "command": " ".join(["python", *sys.argv]),
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "timing": "thread CPU time, 1 thread, min of interleaved rounds",
        "load_average": os.getloadavg(),  # a shared machine's other work, 1/5/15 minutes
        "layers": timings,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
