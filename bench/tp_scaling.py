"""Tensor-parallel scaling on one host's GPUs (issue 21): the same workload at TP=1 and TP=N in
one run, and the collectives' share of a batch-1 decode step.

1. bench/throughput.py at TP=1, then at TP=N (each its own process, one after the other, so
   each finds the GPUs empty): offline tokens/s and batch-1 decode tokens/s.
2. The collectives of one decode step, timed alone over NCCL between N processes: per layer two
   all-reduces of [rows, hidden] (after o_proj and down_proj), one for the embedding, and the
   all-gather of the logits [rows, vocab / N].
The floor of TP=N is N times TP=1's (each GPU reads 1/N of the weights and KV) with free
collectives: the ratios below are against N.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncllm.models.shapes import SHAPES  # noqa: E402


def run_throughput(tp: int, args, out: Path) -> dict:
    command = [
        sys.executable,
        str(ROOT / "bench" / "throughput.py"),
        "--shape",
        args.shape,
        "--tensor-parallel-size",
        str(tp),
        "--num-requests",
        str(args.num_requests),
        "--min-len",
        str(args.min_len),
        "--max-len",
        str(args.max_len),
        "--max-model-len",
        str(2 * args.max_len + 16),
        "--single-stream",
        "--no-peer",
        "--out",
        str(out),
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def _time_collectives(rank: int, world: int, port: int, shape: dict, rows: int, out: Path) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    hidden = torch.randn(rows, shape["hidden_size"], device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(rows, shape["vocab_size"] // world, device="cuda", dtype=torch.bfloat16)
    gathered = torch.empty(world, *logits.shape, device="cuda", dtype=torch.bfloat16)
    layers = shape["num_hidden_layers"]

    def step() -> None:
        for _ in range(2 * layers + 1):
            dist.all_reduce(hidden)
        dist.all_gather_into_tensor(gathered, logits)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 20)
    if rank == 0:
        out.write_text(json.dumps({"rows": rows, "seconds_per_step": best}))
    dist.destroy_process_group()


def time_collectives(world: int, shape: dict, rows: int) -> dict:
    from asyncllm.executor.multiproc import free_port

    out = Path(tempfile.mkdtemp()) / "collectives.json"
    torch.multiprocessing.spawn(
        _time_collectives, (world, free_port(), shape, rows, out), nprocs=world
    )
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    # nano-vllm's offline workload: 256 requests, prompt and output lengths in [100, 1024]
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tp = args.tensor_parallel_size
    folder = Path(tempfile.mkdtemp())
    one = run_throughput(1, args, folder / "tp1.json")
    many = run_throughput(tp, args, folder / f"tp{tp}.json")
    collectives = {
        rows: time_collectives(tp, SHAPES[args.shape], rows)["seconds_per_step"]
        for rows in (1, 256)
    }
    decode_one = one["asyncllm"]["single_stream"]["decode_tokens_per_s"]
    decode_many = many["asyncllm"]["single_stream"]["decode_tokens_per_s"]
    offline_one = one["asyncllm"]["output_tokens_per_s"]
    offline_many = many["asyncllm"]["output_tokens_per_s"]
    result = {
        "benchmark": "tp_scaling",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "device": f"{tp} x {torch.cuda.get_device_name()}",
        "versions": {
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        },
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "shape": args.shape,
        "tp1": one,
        f"tp{tp}": many,
        "batch1_decode_speedup": decode_many / decode_one,
        "offline_speedup": offline_many / offline_one,
        "floor_speedup": tp,
        "collectives_seconds_per_decode_step": collectives,
        "collectives_share_of_batch1_step": collectives[1] * decode_many,
    }
    print(
        f"TP={tp} / TP=1: batch-1 decode {result['batch1_decode_speedup']:.2f}x, offline "
        f"{result['offline_speedup']:.2f}x (floor {tp}x); collectives "
        f"{collectives[1] * 1e6:.0f} us of a batch-1 step "
        f"({result['collectives_share_of_batch1_step']:.0%})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
