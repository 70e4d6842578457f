"""Host work of one decode step without a model (CPU): schedule, input preparation and the
update from the sampled ids, at N running requests, in async scheduling's order (step N+1 is
scheduled and prepared before step N's ids come back, so its inputs wait on the device).

    python bench/scheduler_step.py --out bench/results/scheduler_step_cpu.json

On the H200 these phases took 3.2-4.4 ms a decode step at 256 requests (`bench/NOTES.md`,
change 26), beside about 5 ms of GPU work: this times them where a profile can see them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncllm.config import SchedulerConfig
from asyncllm.core.kv_cache_manager import KVCacheManager  # noqa: E402
from asyncllm.core.scheduler import Scheduler  # noqa: E402
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from asyncllm.engine.core import EngineCore  # noqa: E402
from asyncllm.request import Request  # noqa: E402
from asyncllm.sampling_params import SamplingParams  # noqa: E402
from asyncllm.worker.input_batch import DeviceTokens, InputBatch  # noqa: E402
from asyncllm.worker.step_plan import StepPlan, StepRunner  # noqa: E402

BLOCK_SIZE, MAX_MODEL_LEN, BUDGET = 16, 4096, 8192


class HostStep:
    """A scheduler, KV cache manager and input batch over `num_requests` running requests."""

    def __init__(self, num_requests: int, prefix_caching: bool) -> None:
        rng = random.Random(0)
        config = SchedulerConfig(num_requests, BUDGET, MAX_MODEL_LEN)
        self.scheduler = Scheduler(config, KVCacheManager(40_000, BLOCK_SIZE, prefix_caching))
        self.input_batch = InputBatch(
            num_requests, BUDGET, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu")
        )
        self.core = SimpleNamespace(scheduler=self.scheduler)  # what EngineCore._update reads
        self.times = {"schedule": 0.0, "prepare": 0.0, "update": 0.0}
        for i in range(num_requests):
            prompt = [rng.randrange(100, 50_000) for _ in range(rng.randint(100, 1024))]
            params = SamplingParams(temperature=0.0, ignore_eos=True)
            self.scheduler.add_request(Request(f"r{i}", prompt, params, max_tokens=2_900))
        self.in_flight: tuple[SchedulerOutput, DeviceTokens] | None = None

    def step(self) -> bool:
        """Schedule and prepare step N+1, then take in step N's ids; True for a decode step."""
        start = time.perf_counter()
        output = self.scheduler.schedule()
        scheduled = time.perf_counter()
        decode = all(s.num_new_tokens == 1 for s in output.scheduled)
        previous = self.in_flight[1] if self.in_flight else None
        n = len(output.scheduled)
        plan = StepPlan(StepRunner.DECODE_GRAPH, n, n, pure_decode=True) if decode else None
        self.input_batch.prepare(output, plan, previous)
        prepared = time.perf_counter()
        if self.in_flight is not None:
            done, _ = self.in_flight
            sampled = [7 if s.completes_prompt else None for s in done.scheduled]
            EngineCore._update(self.core, done, ModelRunnerOutput(sampled))
        updated = time.perf_counter()
        ids = {s.request.request_id: row for row, s in enumerate(output.scheduled)}
        self.in_flight = output, DeviceTokens(torch.full((len(ids),), 7), ids)
        for name, seconds in zip(
            self.times, (scheduled - start, prepared - scheduled, updated - prepared)
        ):
            self.times[name] += seconds
        return decode


def time_decode_steps(num_requests: int, prefix_caching: bool, steps: int) -> dict:
    host = HostStep(num_requests, prefix_caching)
    while not host.step():  # the prompts
        pass
    for _ in range(20):
        host.step()
    host.times = dict.fromkeys(host.times, 0.0)
    for _ in range(steps):
        assert host.step()
    per_step = {f"{name}_ms": s / steps * 1e3 for name, s in host.times.items()}
    return {
        "num_requests": num_requests,
        "prefix_caching": prefix_caching,
        "steps": steps,
        **per_step,
        "total_ms": sum(per_step.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3, help="the best of these is kept")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for num_requests in (64, 256):
        for caching in (True, False):
            runs = [
                time_decode_steps(num_requests, caching, args.steps) for _ in range(args.repeats)
            ]
            rows.append(min(runs, key=lambda r: r["total_ms"]))
            print(
                json.dumps(
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}
                )
            )
    result = {
        "benchmark": "scheduler_step",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "decode_steps": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
