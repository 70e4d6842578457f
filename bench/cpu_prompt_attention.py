"""The C++ paged prompt attention of kernels/cpu_decode_attention.cpp against the torch path it
replaces (each request's KV gathered out of the cache, then SDPA), both through the torch
backend's attend on one layer of the default model (SmolLM2-135M: 9 query heads, 3 KV heads of
64, block size 16, float32): one prompt of each --lengths, and one step of --batch prompts of
mixed lengths. Wall-clock time on --threads threads, the minimum over interleaved rounds (the
machine is shared: single times spread by +-8%). GFLOP/s count causal attention's FLOPs only:
4 * head_dim * heads for each (query row, position it attends) pair.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.torch_backend import TorchAttentionBackend
from bench.throughput import cpu_description
from kernels.cpu_decode_attention import cpu_decode_attention_available

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def prompt_step(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Query, cache and metadata of a step prefilling whole prompts of the given lengths, their
    blocks shuffled over the cache as a running engine leaves them."""
    blocks = [-(-n // BLOCK_SIZE) for n in lengths]
    ids = torch.randperm(sum(blocks), dtype=torch.int32)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = ids[start : start + n]
        start += n
    kv_cache = torch.randn(2, sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.arange(starts[-1]),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        query_lens_cpu=lengths,
        seq_lens_cpu=lengths,
    )
    return torch.randn(starts[-1], HEADS, HEAD_DIM), kv_cache, meta


def causal_flops(lengths: list[int]) -> int:
    """Row i of a prompt attends i + 1 positions: scores and weighted values, 2 FLOPs each."""
    return sum(4 * HEAD_DIM * HEADS * n * (n + 1) // 2 for n in lengths)


def seconds(fn, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def time_paths(lengths: list[int], rounds: int) -> dict:
    query, kv_cache, meta = prompt_step(lengths)
    backends = {
        "kernel": TorchAttentionBackend(),
        "gather_sdpa": TorchAttentionBackend(use_cpu_kernel=False),
    }
    outs = {label: torch.empty_like(query) for label in backends}
    calls = {
        label: (lambda b=backend, out=outs[label]: b.attend(query, kv_cache, meta, SCALE, out))
        for label, backend in backends.items()
    }
    inner = max(1, 2_000_000 // (len(query) * max(lengths)))  # a few ms a timing
    best = {label: float("inf") for label in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for label, call in calls.items():
            best[label] = min(best[label], seconds(call, inner))
    flops = causal_flops(lengths)
    return {
        "prompt_lengths": lengths,
        "us_per_call": {label: s * 1e6 for label, s in best.items()},
        "gflops_per_s": {label: flops / s / 1e9 for label, s in best.items()},
        "speedup": best["gather_sdpa"] / best["kernel"],
        "max_abs_difference": (outs["kernel"] - outs["gather_sdpa"]).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="32,136,256", help="comma-separated prompt lengths")
    parser.add_argument(
        "--batch", default="16,24,48,80,136,160,200,256", help="one step's prompt lengths"
    )
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds per case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    assert cpu_decode_attention_available()
    cases = [[int(n)] for n in args.lengths.split(",")]
    cases.append([int(n) for n in args.batch.split(",")])
    result = {
        "benchmark": "cpu_prompt_attention",
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "threads": args.threads,
        "timing": f"wall-clock time, {args.threads} threads, min of {args.rounds} interleaved rounds",
        "paths": {
            "kernel": "TorchAttentionBackend().attend: the C++ paged prompt kernel",
            "gather_sdpa": "TorchAttentionBackend(use_cpu_kernel=False).attend: gather_kv, SDPA",
        },
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK_SIZE},
        "calls": [time_paths(lengths, args.rounds) for lengths in cases],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
