"""Where the structured step's wait for the grammar process goes, on the GPU: bench/structured.py's
constrained batch (256 requests, a JSON schema each, the real tokenizer), with each step's
message timed on both sides of the pipe. The worker side records when it sends a step and when
its receive call returns; the grammar process (a spawned child, so patched through a
sitecustomize on its PYTHONPATH) records when its step function starts and ends. The host's
processes share CLOCK_MONOTONIC, so the spans line up: the message's way there (pipe, the
child's wake, unpickling), the child's own step (accepts and fills), the reply's way back.

    python bench/grammar_process_trace.py --tokenizer .tok/SmolLM2-135M-Instruct --out trace.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

import bench.structured as structured  # noqa: E402
from asyncllm.structured_output import grammar_process  # noqa: E402

_CHILD_PATCH = """
import os, time
from asyncllm.structured_output import grammar_process as gp
real_step = gp._HeldGrammars.step
parts = {}
def timed(name, function):
    def call(*args):
        start = time.monotonic()
        out = function(*args)
        parts[name] = time.monotonic() - start
        return out
    return call
gp.accept_in_batch = timed("accept", gp.accept_in_batch)
gp.allow_all, gp.fill_masks = timed("allow", gp.allow_all), timed("fill", gp.fill_masks)
def step(self, s):
    parts.clear()
    enter, cpu = time.monotonic(), time.process_time()
    out = real_step(self, s)
    left, cpu = time.monotonic(), time.process_time() - cpu
    with open(os.environ["GRAMMAR_PROCESS_TRACE"], "a") as f:
        fields = enter, left, len(s.rows), cpu, *(parts.get(p, 0) for p in ("accept", "allow", "fill"))
        f.write(" ".join(map(str, fields)) + "\\n")
    return out
gp._HeldGrammars.step = step
"""


def patch_worker_side() -> tuple[list, list]:
    """(send times with the step's rows, (receive call, return) times), as the worker meets them."""
    sends, receives = [], []
    real_send, real_receive = (
        grammar_process.GrammarProcess.send,
        grammar_process.GrammarProcess.receive,
    )

    def send(self, step):
        sends.append((time.monotonic(), len(step.rows)))
        return real_send(self, step)

    def receive(self):
        start = time.monotonic()
        out = real_receive(self)
        receives.append((start, time.monotonic()))
        return out

    grammar_process.GrammarProcess.send = send
    grammar_process.GrammarProcess.receive = receive
    return sends, receives


def spans(sends: list, receives: list, child: list, batch: int) -> list[tuple[float, ...]]:
    """Per step with every row in the child (the last 30): there, the child's step, back, the
    child's CPU time in its step (all its threads), its accepts, its rows allowed every token
    and its fills (s)."""
    n = min(len(sends), len(receives), len(child))
    steps = zip(sends[-n:], receives[-n:], child[-n:])
    return [
        (enter - sent, left - enter, back - left, cpu, accept, allow, fill)
        for (sent, rows), (_, back), (enter, left, _, cpu, accept, allow, fill) in steps
        if rows == batch
    ][-30:]


def host_limits() -> dict:
    """What may share or cap this host's cores: the cgroup's CPU quota and the load."""
    quota = Path("/sys/fs/cgroup/cpu.max")
    return {
        "cgroup_cpu_max": quota.read_text().strip() if quota.exists() else None,
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a real tokenizer's folder")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    patch_dir = Path(tempfile.mkdtemp())
    (patch_dir / "sitecustomize.py").write_text(_CHILD_PATCH)
    trace = patch_dir / "trace.txt"
    os.environ["GRAMMAR_PROCESS_TRACE"] = str(trace)
    os.environ["PYTHONPATH"] = f"{patch_dir}:{os.environ.get('PYTHONPATH', '')}"
    sends, receives = patch_worker_side()
    folder = structured.qwen3_folder_with_tokenizer(args.tokenizer)
    step = structured.decode_steps(folder, True, args.batch, args.steps)
    child = [tuple(map(float, line.split())) for line in trace.read_text().splitlines()]
    timed = spans(sends, receives, child, args.batch)

    def median_ms(i: int) -> float:
        return statistics.median(s[i] for s in timed) * 1e3

    result = {
        "benchmark": "grammar_process_trace",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "steps": len(timed),
        "to_child_ms": median_ms(0),
        "child_step_ms": median_ms(1),
        "back_ms": median_ms(2),
        "child_cpu_ms": median_ms(3),
        "child_accept_ms": median_ms(4),
        "child_allow_ms": median_ms(5),
        "child_fill_ms": median_ms(6),
        "host": host_limits(),
        "per_step_ms": [[round(x * 1e3, 2) for x in s] for s in timed],
        "structured_step": step,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_step_ms"}, indent=1))
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
