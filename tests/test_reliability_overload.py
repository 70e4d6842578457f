"""Overload: past --max-concurrent-requests or a full queue, clients get 429 or 503 with
Retry-After, quickly, while the admitted requests run on untouched; a request's own `timeout`
and the server's --max-queue-wait end requests that wait too long."""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import pytest
import pytest_asyncio
from test_reliability_support import (
    engine_is_idle,
    is_openai_error,
    patch_runner,
    report,
    serving,
    until,
)
from test_server_support import parse_sse

from asyncllm import AsyncLLM, EngineArgs

pytestmark = pytest.mark.asyncio(loop_scope="module")

STEP_S = 0.02  # each model step, so a 40-token request runs for about a second
LONG = {"prompt": "long", "max_tokens": 40, "ignore_eos": True, "stream": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir):
    args = EngineArgs(
        model=str(tiny_model_dir), max_model_len=256, max_num_seqs=1, num_kv_blocks=256
    )
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    await engine.shutdown()


@pytest.fixture(autouse=True)
def slow_steps(engine, monkeypatch):
    patch_runner(engine, monkeypatch, seconds=STEP_S)


async def start_stream(session, url, body=LONG) -> aiohttp.ClientResponse:
    """A streaming request whose first event has arrived (so it is running)."""
    response = await session.post(f"{url}/v1/completions", json=body)
    assert response.status == 200
    await response.content.readuntil(b"\n\n")
    return response


async def finish_reason(response: aiohttp.ClientResponse) -> str:
    events = parse_sse(await response.content.read())
    assert events[-1] == "[DONE]"
    return events[-2]["choices"][0]["finish_reason"]


async def timed_refusals(session, url, count: int) -> tuple[list[float], list[aiohttp.ClientResponse]]:  # fmt: skip
    latencies, responses = [], []
    for i in range(count):
        start = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json={"prompt": f"{i}"}) as response:
            await response.read()
        latencies.append(time.perf_counter() - start)
        responses.append(response)
    return latencies, responses


async def test_over_the_concurrency_limit_429_comes_fast_with_retry_after(engine) -> None:
    async with serving(engine, max_concurrent_requests=1) as (url, _), aiohttp.ClientSession() as s:
        admitted = await start_stream(s, url)
        latencies, refused = await timed_refusals(s, url, 20)
        assert {r.status for r in refused} == {429}
        assert all(r.headers["Retry-After"] == "1" for r in refused)
        assert await finish_reason(admitted) == "length"  # untouched by the refusals
    report(
        "429",
        refused=len(refused),
        median_ms=statistics.median(latencies) * 1000,
        max_ms=max(latencies) * 1000,
    )
    assert max(latencies) < 0.5


async def test_a_full_queue_gives_503_with_retry_after(engine) -> None:
    async with serving(engine, max_waiting_requests=1) as (url, _), aiohttp.ClientSession() as s:
        running = await start_stream(s, url)
        queued = asyncio.ensure_future(s.post(f"{url}/v1/completions", json=LONG))
        await until(lambda: engine.core_client.core.scheduler.num_waiting == 1)
        latencies, refused = await timed_refusals(s, url, 20)
        assert {r.status for r in refused} == {503}
        assert all(r.headers["Retry-After"] == "1" for r in refused)
        assert await finish_reason(running) == "length"
        assert await finish_reason(await queued) == "length"
    report(
        "503 queue full",
        refused=len(refused),
        median_ms=statistics.median(latencies) * 1000,
        max_ms=max(latencies) * 1000,
    )
    assert max(latencies) < 0.5


async def test_the_queue_empties_and_admits_again(engine) -> None:
    async with serving(engine, max_waiting_requests=1) as (url, _), aiohttp.ClientSession() as s:
        running = await start_stream(s, url)
        await finish_reason(running)
        async with s.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200


async def test_request_timeout_ends_a_running_request_with_408(engine) -> None:
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "timeout": 0.3}
    async with serving(engine) as (url, _), aiohttp.ClientSession() as s:
        start = time.perf_counter()
        async with s.post(f"{url}/v1/completions", json=body) as response:
            error = await response.json()
        elapsed = time.perf_counter() - start
        assert response.status == 408
        assert is_openai_error(error) and error["error"]["code"] == "request_timeout"
        await until(lambda: engine_is_idle(engine))
    assert 0.3 <= elapsed < 1.5


async def test_request_timeout_ends_a_stream_with_an_error_event(engine) -> None:
    body = {**LONG, "max_tokens": 200, "timeout": 0.3}
    async with serving(engine) as (url, _), aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=body) as response:
            events = parse_sse(await response.read())
        await until(lambda: engine_is_idle(engine))
    assert "choices" in events[0]
    assert is_openai_error(events[-2]) and events[-2]["error"]["code"] == "request_timeout"
    assert events[-1] == "[DONE]"


async def test_request_timeout_ends_a_queued_request(engine) -> None:
    async with serving(engine) as (url, _), aiohttp.ClientSession() as s:
        running = await start_stream(s, url)
        body = {**LONG, "timeout": 0.2}
        async with s.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 408  # before its first token: a plain error response
        assert await finish_reason(running) == "length"
        await until(lambda: engine_is_idle(engine))


async def test_max_queue_wait_ends_requests_not_scheduled_in_time(engine) -> None:
    async with serving(engine, max_queue_wait=0.2) as (url, _), aiohttp.ClientSession() as s:
        running = await start_stream(s, url)  # runs ~1 s: past the wait, yet scheduled
        start = time.perf_counter()
        async with s.post(f"{url}/v1/completions", json=LONG) as waiting:
            error = await waiting.json()
        elapsed = time.perf_counter() - start
        assert waiting.status == 503 and waiting.headers["Retry-After"] == "1"
        assert is_openai_error(error)
        assert await finish_reason(running) == "length"
        await until(lambda: engine_is_idle(engine))
    report("max-queue-wait", wait_s=0.2, refused_after_s=elapsed)
    assert 0.2 <= elapsed < 0.8


async def test_timeout_must_be_positive(engine) -> None:
    async with serving(engine) as (url, _), aiohttp.ClientSession() as s:
        for timeout in (0, -1, "soon"):
            body = {"prompt": "x", "timeout": timeout}
            async with s.post(f"{url}/v1/completions", json=body) as response:
                assert response.status in (400, 422)
                assert (await response.json())["error"]["param"] == "timeout"
