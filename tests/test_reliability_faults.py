"""Fault injection: an exception in the model runner or the sampler for one step ends that
step's requests with an error event, frees their blocks, and the engine serves on; an engine
that cannot continue turns /health to 503 and ends every open stream instead of hanging."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio
from test_reliability_support import (
    engine_is_idle,
    is_openai_error,
    patch_runner,
    serving,
    until,
)
from test_server_support import parse_sse

from asyncllm import AsyncLLM, EngineArgs

pytestmark = pytest.mark.asyncio(loop_scope="module")

STREAM = {"max_tokens": 30, "ignore_eos": True, "stream": True}
BOUND_S = 20.0  # no stream may take longer than this to end


def engine_args(tiny_model_dir) -> EngineArgs:
    return EngineArgs(
        model=str(tiny_model_dir), max_model_len=256, max_num_seqs=8, num_kv_blocks=256
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir):
    engine = AsyncLLM.from_engine_args(engine_args(tiny_model_dir))
    yield engine
    await engine.shutdown()


async def read_events(session, url: str, body: dict) -> list:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200
        return parse_sse(await asyncio.wait_for(response.read(), BOUND_S))


async def concurrent_streams(url: str, count: int) -> list[list]:
    async with aiohttp.ClientSession() as session:
        bodies = [{"prompt": f"stream {i}", **STREAM} for i in range(count)]
        return await asyncio.gather(*(read_events(session, url, b) for b in bodies))


def ended_with_error(events: list) -> bool:
    return events[-1] == "[DONE]" and is_openai_error(events[-2])


def ended_normally(events: list) -> bool:
    return events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


async def serves_a_request(url: str) -> bool:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json={"prompt": "after", "max_tokens": 4}) as r,
    ):
        return r.status == 200 and len((await r.json())["choices"]) == 1


async def test_a_runner_fault_fails_that_steps_requests_and_frees_their_blocks(
    engine, monkeypatch
) -> None:
    steps = patch_runner(engine, monkeypatch, seconds=0.005, fail_on={6})
    async with serving(engine) as (url, _):
        streams = await concurrent_streams(url, 4)
        await until(lambda: engine_is_idle(engine))
        assert len(steps) >= 6
        assert all(ended_with_error(events) for events in streams)
        assert all("choices" in events[0] for events in streams)  # they had started
        assert not engine.errored
        assert await serves_a_request(url)


async def test_a_sampler_fault_fails_that_steps_requests_and_frees_their_blocks(
    engine, monkeypatch
) -> None:
    runner = engine.core_client.core.executor.model_runner
    real_sampler, calls = runner.sampler, []

    def sampler(logits, meta):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault: the sampler fell over")
        return real_sampler(logits, meta)

    monkeypatch.setattr(runner, "sampler", sampler)
    async with serving(engine) as (url, _):
        streams = await concurrent_streams(url, 3)
        await until(lambda: engine_is_idle(engine))
        assert all(ended_with_error(events) for events in streams)
        assert not engine.errored
        assert await serves_a_request(url)
        assert all(ended_normally(events) for events in await concurrent_streams(url, 3))


async def test_a_fault_spares_requests_outside_the_failed_step(engine, monkeypatch) -> None:
    patch_runner(engine, monkeypatch, seconds=0.005, fail_on={10})
    async with serving(engine) as (url, _), aiohttp.ClientSession() as session:
        body = {"prompt": "early", "max_tokens": 3, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            early = await response.json()  # steps 1-3, before the fault
        streams = await concurrent_streams(url, 2)
        await until(lambda: engine_is_idle(engine))
    assert early["choices"][0]["finish_reason"] == "length"
    assert all(ended_with_error(events) for events in streams)


async def test_a_dead_engine_ends_every_stream_and_fails_health(tiny_model_dir) -> None:
    engine = AsyncLLM.from_engine_args(engine_args(tiny_model_dir))
    try:
        await check_dead_engine(engine)
    finally:
        await engine.shutdown()


async def check_dead_engine(engine: AsyncLLM) -> None:
    scheduler = engine.core_client.core.scheduler
    real_schedule, steps = scheduler.schedule, []

    def schedule():
        steps.append(1)
        if len(steps) == 8:
            raise RuntimeError("injected fault: the scheduler's state is broken")
        return real_schedule()

    scheduler.schedule = schedule
    # without a restart (test_reliability_core_death checks those), the engine stays down
    async with (
        serving(engine, engine_restart=False) as (url, _),
        aiohttp.ClientSession() as session,
    ):
        body = {"prompt": "doomed", **STREAM, "max_tokens": 200}
        sse = [asyncio.ensure_future(read_events(session, url, body)) for _ in range(3)]
        ws = await session.ws_connect(f"{url}/v1/stream")
        await ws.send_json({"id": "w", "endpoint": "completions", "body": body})
        frames = [await asyncio.wait_for(ws.receive_json(), BOUND_S)]
        while frames[-1]["type"] != "done":
            frames.append(await asyncio.wait_for(ws.receive_json(), BOUND_S))
        streams = await asyncio.gather(*sse)
        await ws.close()
        async with session.get(f"{url}/health") as health:
            assert health.status == 503
        async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as refused:
            assert refused.status == 503
            assert is_openai_error(await refused.json())
    assert engine.errored
    assert all(ended_with_error(events) for events in streams)
    assert all(events[-2]["error"]["type"] == "service_unavailable" for events in streams)
    assert [f["type"] for f in frames[-2:]] == ["error", "done"]
