"""Where the offline throughput run's GPU time goes: bench/throughput.py's workload under
torch.profiler (GPU activity only), each kernel's total time, and how long the GPU sat idle.

    python bench/profile_offline.py --shape qwen3-0.6b --out $OUT/profile_offline.json

The profiler slows the run; its wall time is for the idle share, not a throughput figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow kernels
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from asyncllm import LLM, SamplingParams  # noqa: E402
from asyncllm.models.shapes import SHAPES, write_shape  # noqa: E402
from bench.throughput import make_workload  # noqa: E402


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in, seconds out)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


_GAP_BINS = ((10, "<10us"), (100, "10-100us"), (1e3, "0.1-1ms"), (float("inf"), ">1ms"))


def idle_breakdown(kernels: list[tuple[float, float, str]], top: int = 8) -> dict:
    """Where the GPU sat idle between its first and last kernel ((start, end, name), in
    microseconds): the idle seconds in each tenth of that span, the gaps by length, and the
    kernels that most idle time came before (the host was late to launch them)."""
    kernels = sorted(kernels)
    first, last = kernels[0][0], max(end for _, end, _ in kernels)
    tenth = (last - first) / 10
    by_tenth = [0.0] * 10
    bins = {name: 0.0 for _, name in _GAP_BINS}
    before: dict[str, float] = {}
    reach = first
    for start, end, name in kernels:
        gap = start - reach
        if gap > 0:
            by_tenth[min(int((reach - first) / tenth), 9)] += gap / 1e6
            key = next(name for limit, name in _GAP_BINS if gap < limit)
            bins[key] += gap / 1e6
            before[name[:60]] = before.get(name[:60], 0.0) + gap / 1e6
        reach = max(reach, end)
    return {
        "span_s": (last - first) / 1e6,
        "idle_s_by_tenth_of_span": by_tenth,
        "idle_s_by_gap_length": bins,
        "idle_s_before_kernel": dict(sorted(before.items(), key=lambda kv: -kv[1])[:top]),
    }


def dummy_llm(shape: str, max_num_batched_tokens: int, quantization: str | None = None) -> LLM:
    """An engine over a benchmark shape with dummy weights (quantized at load if asked)."""
    path = write_shape(shape, Path(tempfile.mkdtemp(prefix=f"{shape}-")))
    return LLM(
        model=str(path),
        load_format="dummy",
        quantization=quantization,
        max_model_len=4096,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """bench/throughput.py's offline workload, for one benchmark shape."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--quantization", help="e.g. fp8: the weights quantized at load")


def warmed_up_workload(args: argparse.Namespace) -> tuple[LLM, list[dict], list[SamplingParams]]:
    """An engine over the shape with dummy weights, after a short warm-up generation, and the
    workload's prompts and sampling params."""
    llm = dummy_llm(args.shape, args.max_num_batched_tokens, args.quantization)
    vocab = SHAPES[args.shape]["vocab_size"]
    workload = make_workload(args.num_requests, args.min_len, args.max_len, vocab, 0)
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in workload]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    return llm, prompts, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_workload_args(parser)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    llm, prompts, params = warmed_up_workload(args)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    totals: dict[str, list[float]] = {}
    for e in kernels:
        entry = totals.setdefault(e.name[:90], [0.0, 0])
        entry[0] += e.time_range.elapsed_us() / 1e6
        entry[1] += 1
    busy = busy_seconds([(e.time_range.start, e.time_range.end) for e in kernels])
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:25]
    result = {
        "benchmark": "profile_offline",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__},
        "workload": vars(args) | {"out": str(args.out)},
        "wall_s_profiled": wall,
        "gpu_busy_s": busy,
        "gpu_idle_fraction": 1 - busy / wall,
        "idle": idle_breakdown([(e.time_range.start, e.time_range.end, e.name) for e in kernels]),
        "kernels": {name: {"s": s, "calls": n} for name, (s, n) in top},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
