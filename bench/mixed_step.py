"""What one prompt arriving costs the requests already decoding: the wall time of engine steps
that mix a prefill into a running decode batch, against pure decode steps (one engine, one run).

At serving's half load a new prompt arrives every few dozen steps and every running stream
waits for that step, so the mixed step's time is what the p99 inter-token latency shows.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm import LLM, SamplingParams
from asyncllm.models.shapes import SHAPES
from bench.profile_offline import busy_seconds, dummy_llm


def timed_steps(llm: LLM, n: int) -> list[float]:
    """Wall seconds of n engine steps, outputs processed as the engine loop does."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        llm.process_step(llm.core_client.get_output())
        times.append(time.perf_counter() - start)
    return times


def profiled(run: Callable[[], object]) -> dict:
    """run() under torch.profiler: its wall time, how long the GPU was busy in it, and where
    the host's and the GPU's time went (both threads' host ops, self time)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    events = prof.key_averages()

    def top(device: str, key: str) -> dict[str, float]:
        chosen = sorted(
            (e for e in events if e.device_type.name == device),
            key=lambda e: getattr(e, key),
            reverse=True,
        )[:12]
        return {e.key[:80]: getattr(e, key) / 1e6 for e in chosen}

    return {
        "wall_s": wall,
        "gpu_busy_s": busy_seconds([(e.time_range.start, e.time_range.end) for e in kernels]),
        "gpu_kernels_s": top("CUDA", "self_device_time_total"),
        "host_ops_self_s": top("CPU", "self_cpu_time_total"),
    }


def host_profiled(run: Callable[[], object], top: int = 25) -> dict:
    """run() under cProfile: the functions with the most time of their own (EngineCore.step()
    launches each step from this thread, so the launches' host cost is here)."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    rows = []
    for (path, line, name), (_, calls, own, total, _) in stats.stats.items():
        rows.append((own, f"{Path(path).name}:{line}({name})", calls, total))
    rows.sort(reverse=True)
    return {
        key: {"calls": calls, "own_s": own, "total_s": total}
        for own, key, calls, total in rows[:top]
    }


def add(llm: LLM, request_id: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request, _ = llm.input_processor.process(
        request_id, {"prompt_token_ids": prompt}, params, 0, True
    )
    llm.add_request(request, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=28, help="requests decoding")
    parser.add_argument("--prompt-len", type=int, default=580, help="the arriving prompt")
    parser.add_argument("--arrivals", type=int, default=20)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--profile", action="store_true", help="also profile both kinds of step")
    parser.add_argument(
        "--host-profile", action="store_true", help="also cProfile the steps around arrivals"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    llm = dummy_llm(args.shape, args.max_num_batched_tokens)
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randint(100, vocab - 1) for _ in range(n)]

    for i in range(args.batch):
        add(llm, f"d{i}", prompt(args.prompt_len), 3000)
    timed_steps(llm, 40)  # prefill them, warm up the decode graphs
    decode = timed_steps(llm, 200)
    mixed = []
    for i in range(args.arrivals):
        add(llm, f"a{i}", prompt(args.prompt_len), 3000)
        # the step that prefills it (and, with async scheduling, the one launched next to it)
        around = timed_steps(llm, 4)
        mixed.append(max(around))
        timed_steps(llm, 10)
    median_decode = statistics.median(decode)

    def arrivals(tag: str) -> Callable[[], None]:
        def run() -> None:
            for i in range(5):
                add(llm, f"{tag}{i}", prompt(args.prompt_len), 3000)
                timed_steps(llm, 4)

        return run

    profiles = {}
    if args.profile:  # the same number of steps of each kind: 4 around each of 5 arrivals
        profiles["decode_steps"] = profiled(lambda: timed_steps(llm, 20))
        profiles["steps_around_arrivals"] = profiled(arrivals("p"))
    if args.host_profile:
        profiles["host_decode_steps"] = host_profiled(lambda: timed_steps(llm, 20))
        profiles["host_steps_around_arrivals"] = host_profiled(arrivals("h"))
    result = {
        "benchmark": "mixed_step",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "shape": args.shape,
        "decode_batch": args.batch,
        "prompt_len": args.prompt_len,
        "async_scheduling": llm.config.async_scheduling,
        "median_decode_step_ms": median_decode * 1e3,
        "p99_decode_step_ms": statistics.quantiles(decode, n=100)[98] * 1e3,
        "median_mixed_step_ms": statistics.median(mixed) * 1e3,
        "mixed_over_decode": statistics.median(mixed) / median_decode,
    } | ({"profiles": profiles} if profiles else {})
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
