"""The C++ paged decode attention of kernels/cpu_decode_attention.cpp on one layer of the default
model (9 query heads, 3 KV heads of 64, block size 16), one thread, in thread CPU time; with
--baseline REV, against the kernel of that git revision in the same process, rounds interleaved.
--layers 30 runs a decode step's 30 layers, each on a cache of its own: together past the L3,
so the KV comes from DRAM as in the engine (one layer's stays in cache between rounds).
--threads N runs the kernel on N threads, as the engine does, timed by the wall clock (the
calling thread's CPU time would count its wait for the others).

The machine is shared and loaded: wall-clock times of one op spread by 5x, the CPU time of the
calling thread by about 20% (the rest is others' use of L3 and memory bandwidth), so each figure
is the minimum over rounds. The baseline's source is built under its own operator namespace
(asyncllm_cpu_baseline) so that both kernels load into one process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.throughput import cpu_description
from kernels.cpu_decode_attention import SOURCE, cpu_decode_attention_available
from kernels.cpu_extension import build

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def build_baseline(rev: str) -> object:
    """The kernel as it was at rev, built under the namespace asyncllm_cpu_baseline."""
    source = subprocess.run(
        ["git", "show", f"{rev}:kernels/cpu_decode_attention.cpp"],
        cwd=SOURCE.parent,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    renamed = source.replace("TORCH_LIBRARY(asyncllm_cpu,", "TORCH_LIBRARY(asyncllm_cpu_baseline,")
    path = Path(tempfile.mkdtemp()) / "cpu_decode_attention_baseline.cpp"
    path.write_text(renamed)
    build("asyncllm_cpu_decode_attention_baseline", path)
    return torch.ops.asyncllm_cpu_baseline.paged_decode_attention


def layer_inputs(requests: int, context: int, layers: int) -> tuple:
    blocks = -(-context // BLOCK_SIZE)
    kv_caches = [
        torch.randn(2, requests * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(layers)
    ]
    # every request's blocks spread over the cache, as a running engine leaves them
    tables = torch.randperm(requests * blocks, dtype=torch.int32).view(requests, blocks)
    lens = torch.full((requests,), context, dtype=torch.int32)
    query = torch.randn(requests, HEADS, HEAD_DIM)
    return query, kv_caches, tables, lens


def seconds(fn, clock, inner: int = 3) -> float:
    start = clock()
    for _ in range(inner):
        fn()
    return (clock() - start) / inner


def time_kernels(
    kernels: dict, requests: int, context: int, rounds: int, layers: int, clock
) -> dict:
    query, kv_caches, tables, lens = layer_inputs(requests, context, layers)
    outs = {label: torch.empty_like(query) for label in kernels}

    def step(op, out) -> None:
        for kv_cache in kv_caches:
            op(query, kv_cache, tables, lens, 0.125, out)

    calls = {label: (lambda op=op, out=outs[label]: step(op, out)) for label, op in kernels.items()}
    best = {label: float("inf") for label in kernels}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for label, call in calls.items():
            best[label] = min(best[label], seconds(call, clock))
    flops = 4 * requests * HEADS * HEAD_DIM * context * layers
    kv_bytes = 2 * requests * context * KV_HEADS * HEAD_DIM * 4 * layers
    reference = next(iter(outs.values()))
    return {
        "requests": requests,
        "context": context,
        "layers": layers,
        "ms_per_call": {label: s * 1e3 for label, s in best.items()},
        "gflops_per_s": {label: flops / s / 1e9 for label, s in best.items()},
        "kv_gb_per_s": {label: kv_bytes / s / 1e9 for label, s in best.items()},
        "max_abs_difference": max((o - reference).abs().max().item() for o in outs.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", default=None, help="git revision to compare against")
    parser.add_argument("--contexts", default="100,300,500", help="comma-separated lengths")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per context")
    parser.add_argument("--layers", type=int, default=1, help="layers a call, a cache each")
    parser.add_argument("--threads", type=int, default=1, help="over 1: wall-clock time")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    assert cpu_decode_attention_available()
    kernels = {"current": torch.ops.asyncllm_cpu.paged_decode_attention}
    if args.baseline:
        kernels[f"baseline {args.baseline}"] = build_baseline(args.baseline)
    contexts = [int(c) for c in args.contexts.split(",")]
    result = {
        "benchmark": "cpu_decode_attention",
        "command": " ".join(["python", *sys.argv]),
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "timing": (
            "thread CPU time, 1 thread"
            if args.threads == 1
            else f"wall-clock time, {args.threads} threads"
        )
        + ", min of interleaved rounds",
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK_SIZE},
        "calls": [
            time_kernels(kernels, args.requests, c, args.rounds, args.layers, clock)
            for c in contexts
        ],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
