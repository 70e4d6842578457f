"""The debugging switches (asyncllm/debugging.py): ASYNCLLM_LOGGING_LEVEL=DEBUG logs each
request's path, ASYNCLLM_TRACE_FUNCTION=1 writes a per-process call trace, ASYNCLLM_LOG_SCHEDULER=1
logs each step's decisions, and --profiler-dir serves POST /start_profile and /stop_profile,
which write a torch profiler trace of the engine core."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys

import aiohttp
import pytest
from test_reliability_support import serving

from asyncllm import LLM, AsyncLLM, EngineArgs, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

SWITCHES = ("ASYNCLLM_TRACE_FUNCTION", "ASYNCLLM_LOG_SCHEDULER", "ASYNCLLM_TORCH_PROFILER_DIR")


@pytest.fixture(autouse=True)
def no_switches(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


def engine_args(tiny_model_dir, **kwargs) -> EngineArgs:
    return EngineArgs(model=str(tiny_model_dir), max_model_len=256, **kwargs)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120
    )


async def test_the_logging_level_comes_from_the_environment() -> None:
    code = "from asyncllm.debugging import configure_logging as c; import logging as l; c(); print(l.getLogger().level)"  # fmt: skip
    assert run_python(code, ASYNCLLM_LOGGING_LEVEL="debug").stdout.split() == ["10"]
    assert run_python(code).stdout.split() == ["20"]


async def test_debug_logging_shows_each_requests_path(tiny_model_dir, caplog) -> None:
    engine = AsyncLLM.from_engine_args(engine_args(tiny_model_dir))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    try:
        with caplog.at_level(logging.DEBUG, logger="asyncllm"):
            async for _ in engine.generate("hello", params, "traced"):
                pass
            long = SamplingParams(max_tokens=200, ignore_eos=True)  # runs until aborted
            stream = engine.generate("bye", long, "left")
            await anext(stream)
            await stream.aclose()
            while engine.core_client.core.has_work():  # the abort reaches the core
                await asyncio.sleep(0.01)
    finally:
        await engine.shutdown()
    path = [r.getMessage() for r in caplog.records if "request traced" in r.getMessage()]
    assert path == [
        "request traced: received",
        "request traced: 1 prompt tokens, to the core",
        "request traced: in the core",
        "request traced: scheduled",
        "request traced: finished in the core",
        "request traced: finished",
    ]
    assert "request left: aborted" in caplog.messages
    assert "requests ['left']: FINISHED_ABORTED from the front end" in caplog.messages


async def test_function_trace_writes_a_file_per_process(tmp_path) -> None:
    code = (
        "import threading\n"
        "from asyncllm.debugging import start_function_trace\n"
        "print(start_function_trace('probe'))\n"
        "from asyncllm.sampling_params import SamplingParams\n"
        "SamplingParams(max_tokens=3)\n"
        "t = threading.Thread(target=SamplingParams, kwargs={'seed': 1}, name='other')\n"
        "t.start(); t.join()\n"
    )
    done = run_python(code, ASYNCLLM_TRACE_FUNCTION="1", ASYNCLLM_TRACE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    (trace,) = tmp_path.iterdir()
    assert trace.name.startswith("probe_pid") and done.stdout.strip() == str(trace)
    lines = trace.read_text().splitlines()
    calls = [line for line in lines if " Call to SamplingParams.__post_init__ in " in line]
    assert {line.split()[1] for line in calls} == {"MainThread", "other"}
    assert any(" Return from SamplingParams.__post_init__ in " in line for line in lines)
    traced_files = {line.split(" in ", 1)[1].rsplit(":", 1)[0] for line in lines}
    assert all("/asyncllm/" in f for f in traced_files)  # only the package's own code


async def test_no_trace_without_the_switch(tmp_path) -> None:
    code = "from asyncllm.debugging import start_function_trace as s; print(s('probe'))"
    assert run_python(code, ASYNCLLM_TRACE_DIR=str(tmp_path)).stdout.split() == ["None"]
    assert not list(tmp_path.iterdir())


async def test_scheduler_logging_shows_each_steps_decisions(
    tiny_model_dir, monkeypatch, caplog
) -> None:
    """8 blocks of 16 tokens for 4 requests that grow to 5 blocks each: some are preempted."""
    monkeypatch.setenv("ASYNCLLM_LOG_SCHEDULER", "1")
    llm = LLM(**vars(engine_args(tiny_model_dir, num_kv_blocks=8, max_num_batched_tokens=256)))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="asyncllm.engine.core"):
        llm.generate([f"prompt number {i}" for i in range(4)], params, use_tqdm=False)
    steps = [m for m in caplog.messages if m.startswith("step: ")]
    first = steps[0]
    assert first.startswith("step: scheduled 4 [") and " preempted 0 [] tokens " in first
    assert first.endswith(" running 4 waiting 0") and "/256 kv_blocks " in first
    assert " kv_blocks 4/8 " in first  # one block each for the short prompts
    preempting = [s for s in steps if " preempted 0 " not in s]
    assert preempting and all(" preempted 1 [" in s or " preempted 2 [" in s for s in preempting)
    assert len(steps) >= 60


async def test_no_profile_routes_without_a_folder(tiny_model_dir) -> None:
    engine = AsyncLLM.from_engine_args(engine_args(tiny_model_dir))
    try:
        async with (
            serving(engine) as (url, _),
            aiohttp.ClientSession() as session,
            session.post(f"{url}/start_profile") as response,
        ):
            assert response.status == 404
    finally:
        await engine.shutdown()


async def test_profile_routes_write_a_torch_trace_of_the_core(tiny_model_dir, tmp_path) -> None:
    engine = AsyncLLM.from_engine_args(engine_args(tiny_model_dir, profiler_dir=str(tmp_path)))
    body = {"prompt": "profiled", "max_tokens": 4}
    try:
        async with serving(engine) as (url, _), aiohttp.ClientSession() as session:
            async with session.post(f"{url}/start_profile") as response:
                assert response.status == 200
            async with session.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200
            async with session.post(f"{url}/stop_profile") as response:
                assert response.status == 200
            for _ in range(500):
                if list(tmp_path.glob("*.pt.trace.json")):
                    break
                await asyncio.sleep(0.02)
    finally:
        await engine.shutdown()
    (trace,) = tmp_path.glob("engine_core_pid*.pt.trace.json")
    names = {event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)
