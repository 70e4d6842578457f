"""Helpers the reliability tests share: an in-process server around an engine that can be
slowed down or broken, OpenAI error-shape checks, and the figures the README quotes.

No tests here; the test_reliability_* files import from this module.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from test_server_support import serving  # noqa: F401 (re-exported for the reliability tests)

from asyncllm import AsyncLLM

ERROR_FIELDS = {"message", "type", "param", "code"}


def patch_runner(engine: AsyncLLM, monkeypatch, seconds: float = 0.0, fail_on: set[int] = frozenset()) -> list[int]:  # fmt: skip
    """Each model step sleeps `seconds` (in the runner thread); the steps numbered in fail_on
    (1-based) raise instead. Returns the list of step numbers run so far."""
    runner = engine.core_client.core.executor.model_runner
    real_execute = runner.execute_model
    steps: list[int] = []

    def execute(scheduler_output):
        steps.append(len(steps) + 1)
        time.sleep(seconds)
        if len(steps) in fail_on:
            raise RuntimeError("injected fault: the device fell over")
        return real_execute(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", execute)
    return steps


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def is_openai_error(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and set(body) == {"error"}
        and isinstance(body["error"], dict)
        and set(body["error"]) == ERROR_FIELDS
        and isinstance(body["error"]["message"], str)
        and isinstance(body["error"]["type"], str)
    )


def engine_is_idle(engine: AsyncLLM) -> bool:
    core = engine.core_client.core
    return not core.has_work() and core.kv_cache_manager.usage == 0


def rss_kib(pid: int) -> int:
    """Resident set size of a process, from /proc (psutil is not installed)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def report(name: str, **figures: Any) -> None:
    """One line of measured figures (shown with pytest -s). With $ASYNCLLM_RELIABILITY_RESULTS
    set, they are also merged into that JSON file: the README quotes bench/results/."""
    values = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())  # fmt: skip
    print(f"\nRELIABILITY {name}: {values}", flush=True)
    path = os.environ.get("ASYNCLLM_RELIABILITY_RESULTS")
    if path:
        results = json.loads(Path(path).read_text()) if Path(path).exists() else _machine()
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}
        results.setdefault("figures", {})[name] = rounded
        Path(path).write_text(json.dumps(results, indent=2) + "\n")


def _machine() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command(),
        "device": platform.machine(),
        "cpu": _cpu(),
        "cpu_threads": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


_VECTOR_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def _cpu() -> dict[str, Any]:
    """The CPU's model and vector extensions, which every CPU result names."""
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = info.get("flags", "").split()
    model = info.get("model name", platform.processor())
    return {"model": model, "vector_extensions": [f for f in _VECTOR_FLAGS if f in flags]}


def _command() -> str:
    """The pytest run that measured, with the ASYNCLLM_ settings it ran under."""
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("ASYNCLLM_")]
    return " ".join([*settings, "python -m pytest", *sys.argv[1:]])
