"""Tensor-parallel failures: a shape that cannot split is refused at start-up with the reason;
a worker that dies mid-stream ends the streams with an error and stops the engine; one killed
while the engine idles (worker processes or Ray actors) is noticed within 1 s (/health 503) and
the server starts a new engine that serves. None leaves a process behind."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from test_reliability_core_death import NOTICE_S, RESTART_BOUND_S, seconds_until_health
from test_reliability_support import report, serving
from test_tensor_parallel import save_random_model

from asyncllm import LLM, AsyncLLM, EngineArgs, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def test_heads_that_cannot_split_are_refused_with_the_reason(tmp_path) -> None:
    path = save_random_model("llama", tmp_path)  # 4 query heads
    with pytest.raises(
        RuntimeError, match=r"attention heads \(4\) cannot be split evenly across 3"
    ):
        LLM(model=str(path), tensor_parallel_size=3, max_model_len=64, max_num_seqs=2)
    assert not multiprocessing.active_children()


async def test_a_worker_that_dies_ends_the_stream_with_an_error(tmp_path) -> None:
    path = save_random_model("llama", tmp_path)
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=str(path), tensor_parallel_size=2, max_model_len=128, max_num_seqs=2)
    )
    executor = engine.core_client.core.executor
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    stream = engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "r")
    await anext(stream)
    os.kill(executor.worker_pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(Exception, match="tensor-parallel worker 1"):
        async for _ in stream:
            pass
    ended = time.monotonic() - start
    report("tp worker killed mid-stream", stream_ended_s=ended)
    assert ended < NOTICE_S
    assert engine.errored
    await engine.shutdown()
    await asyncio.sleep(0)
    assert not multiprocessing.active_children()


async def serves_token_ids(session: aiohttp.ClientSession, url: str) -> bool:
    """A model without a tokenizer takes token ids."""
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status == 200 and len((await response.json())["choices"]) == 1


async def killed_while_idle_and_replaced(engine: AsyncLLM, worker_pid: Callable[[], int]) -> float:
    """Kills a worker of the serving engine while it idles; returns how soon /health was 503.
    The supervisor restarts the engine, which then serves again."""
    async with serving(engine) as (url, _), aiohttp.ClientSession() as session:
        assert await serves_token_ids(session, url)
        first = engine.core_client
        os.kill(worker_pid(), signal.SIGKILL)
        noticed = await seconds_until_health(session, url, 503, NOTICE_S)
        await seconds_until_health(session, url, 200, RESTART_BOUND_S)
        assert engine.core_client is not first
        assert await serves_token_ids(session, url)
    return noticed


async def test_a_worker_killed_while_idle_is_noticed_and_the_engine_restarts(tmp_path) -> None:
    """The CPU default: the core in the server's process, the executor's collector watching."""
    path = save_random_model("llama", tmp_path)
    args = EngineArgs(model=str(path), tensor_parallel_size=2, max_model_len=128, max_num_seqs=2)
    engine = AsyncLLM.from_engine_args(args)
    old = engine.core_client.core.executor.worker_pids
    try:
        noticed = await killed_while_idle_and_replaced(engine, lambda: old[1])
        new = engine.core_client.core.executor.worker_pids
    finally:
        await engine.shutdown()
    report("tp worker killed idle", health_503_s=noticed)
    assert noticed < NOTICE_S
    assert not any(Path(f"/proc/{pid}").exists() for pid in old + new)  # reaped, not zombies
    assert not multiprocessing.active_children()


async def test_a_ray_worker_killed_while_idle_is_noticed_and_the_engine_restarts(
    tmp_path, monkeypatch
) -> None:
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # Ray's workers import this tree
    path = save_random_model("llama", tmp_path)
    # a cluster of its own, not one another test file's process has running on this machine
    ray.init(address="local", num_cpus=2)
    try:
        args = EngineArgs(
            model=str(path),
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            max_model_len=128,
            max_num_seqs=2,
        )
        engine = AsyncLLM.from_engine_args(args)
        old = engine.core_client.core.executor.workers
        pid = ray.get(old[1].__ray_call__.remote(lambda worker: os.getpid()))
        try:
            noticed = await killed_while_idle_and_replaced(engine, lambda: pid)
            new = engine.core_client.core.executor.workers
        finally:
            await engine.shutdown()
        for worker in old + new:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(worker.__ray_call__.remote(lambda worker: None), timeout=30)
        states = {g["state"] for g in ray.util.placement_group_table().values()}
    finally:
        ray.shutdown()
    report("ray worker killed idle", health_503_s=noticed)
    assert noticed < NOTICE_S
    assert states == {"REMOVED"}
