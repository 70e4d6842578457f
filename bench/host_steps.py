"""Host time of each engine step of the offline workload (bench/throughput.py's), by phase: a
step whose `wait` is near zero found the GPU done, so the host set its pace.

    python bench/host_steps.py --out $OUT/host_steps.json

One `EngineCore.step` with async scheduling launches step N+1 (schedule, execute_model: prepare,
sampling_metadata, forward) and then finishes step N (wait, update, process); its row is
labelled with the tokens and requests of the step it launched.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

# run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow kernels
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from bench.profile_offline import add_workload_args, warmed_up_workload  # noqa: E402
from bench.throughput import time_phases  # noqa: E402


def record_steps(llm) -> list[dict]:
    """Each LLM step's wall time and phases (ms), appended to the returned list as it runs."""
    core, runner = llm.core_client.core, llm.core_client.core.executor.model_runner
    phases = time_phases(llm, ((runner, "_forward"),))
    steps: list[dict] = []
    scheduled: list = []  # the step's scheduler output
    inner_step, inner_schedule = core.step, core.scheduler.schedule

    def schedule(*args, **kwargs):
        scheduled.append(inner_schedule(*args, **kwargs))
        return scheduled[-1]

    def step():
        start = time.perf_counter()
        outputs = inner_step()
        row = {"step": (time.perf_counter() - start) * 1e3}
        if scheduled and scheduled[-1] is not None:
            row["tokens"] = scheduled[-1].total_num_scheduled_tokens
            row["requests"] = len(scheduled[-1].scheduled)
        steps.append(row | {name: s * 1e3 for name, s in phases.items()})
        phases.clear()
        scheduled.clear()
        return outputs

    core.step, core.scheduler.schedule = step, schedule
    return steps


def summarize(steps: list[dict]) -> dict:
    """Mean step, wait and host (step - wait) time of steps with prompt tokens and of the rest."""
    kinds = {
        "with_prompt_tokens": [s for s in steps if s.get("tokens", 0) > s.get("requests", 0)],
        "decode_only": [s for s in steps if 0 < s.get("tokens", 0) <= s.get("requests", 0)],
    }
    return {
        kind: {
            "steps": len(rows),
            "mean_step_ms": statistics.fmean(r["step"] for r in rows),
            "mean_wait_ms": statistics.fmean(r.get("wait", 0.0) for r in rows),
            "mean_host_ms": statistics.fmean(r["step"] - r.get("wait", 0.0) for r in rows),
        }
        for kind, rows in kinds.items()
        if rows
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--first-steps", type=int, default=40, help="steps listed one by one")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    llm, prompts, params = warmed_up_workload(args)
    steps = record_steps(llm)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    result = {
        "benchmark": "host_steps",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {"torch": torch.__version__},
        "workload": vars(args) | {"out": str(args.out)},
        "wall_s": wall,
        "num_steps": len(steps),
        "by_kind": summarize(steps),
        "first_steps_ms": steps[: args.first_steps],
    }
    print(json.dumps(result["by_kind"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
