"""Where a decode step's time goes on the GPU: torch.profiler over a batch-B decode run (all
threads' host ops and the GPU kernels), plus a check that waiting on a CUDA event releases the GIL.

    python bench/profile_decode.py --shape qwen3-0.6b --batch 1 --out $OUT/profile_decode.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow kernels
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from asyncllm import LLM, SamplingParams  # noqa: E402
from asyncllm.models.shapes import write_shape  # noqa: E402


def event_wait_releases_gil() -> dict:
    """Counts Python loop iterations in a thread while the main thread waits on a ~50 ms GPU op."""
    count, stop = 0, threading.Event()

    def spin() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.01)
    before = count
    torch.cuda._sleep(100_000_000)
    event = torch.cuda.Event()
    event.record()
    start = time.perf_counter()
    event.synchronize()
    waited = time.perf_counter() - start
    during = count - before
    stop.set()
    thread.join()
    return {"waited_s": waited, "spins_while_waiting": during}


def profile_decode(llm: LLM, batch: int, steps: int) -> dict:
    prompts = [{"prompt_token_ids": list(range(100 + i, 228 + i))} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    host = sorted(
        (e for e in events if e.device_type.name == "CPU"),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )[:25]
    kernels = sorted(
        (e for e in events if e.device_type.name == "CUDA"),
        key=lambda e: e.self_device_time_total,
        reverse=True,
    )[:15]
    return {
        "batch": batch,
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "gpu_kernel_ms_per_step": gpu_us / 1e3 / steps,
        "host_ops_self_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / steps for e in host},
        "host_op_calls_per_step": {e.key: e.count / steps for e in host},
        "gpu_kernels_ms_per_step": {
            e.key[:80]: e.self_device_time_total / 1e3 / steps for e in kernels
        },
        "gpu_kernel_launches_per_step": sum(e.count for e in events if e.device_type.name == "CUDA")
        / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    folder = write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    llm = LLM(model=str(folder), load_format="dummy", max_model_len=4096)
    result = {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "event_wait": event_wait_releases_gil(),
        "runs": [profile_decode(llm, b, args.steps) for b in args.batch],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
