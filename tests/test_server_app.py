"""build_app in this process on a real socket, where the engine can be slowed down or broken:
keep-alive while queued, slow readers, failures mid-stream, draining, per-app metrics."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest
import pytest_asyncio
from test_server_support import parse_sse, serving

from asyncllm import AsyncLLM, EngineArgs
from asyncllm.server import build_app
from asyncllm.server.app import STATE
from asyncllm.server.openai_routes import OpenAIRoutes
from asyncllm.server.streaming import DONE

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir):
    args = EngineArgs(
        model=str(tiny_model_dir), max_model_len=512, max_num_seqs=1, num_kv_blocks=512
    )
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    await engine.shutdown()


def slow_down(engine: AsyncLLM, monkeypatch, seconds: float, fail_on_call: int = 0) -> None:
    runner = engine.core_client.core.executor.model_runner
    real_execute = runner.execute_model
    calls = 0

    def execute(scheduler_output):
        nonlocal calls
        calls += 1
        time.sleep(seconds)
        if calls == fail_on_call:
            raise RuntimeError("the device fell over")
        return real_execute(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", execute)


STREAM = {"stream": True, "ignore_eos": True, "temperature": 0}


async def test_keepalive_comments_while_a_request_waits_in_the_queue(engine, monkeypatch) -> None:
    slow_down(engine, monkeypatch, 0.03)
    async with serving(engine, keepalive_interval=0.1) as (url, _), aiohttp.ClientSession() as s:
        first = await s.post(
            f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 25, **STREAM}
        )
        await first.content.readuntil(b"data: ")
        assert engine.core_client.core.scheduler.num_running == 1  # max_num_seqs=1: the next waits
        queued = await s.post(
            f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 2, **STREAM}
        )
        head = await queued.content.readuntil(b"data: ")
        body = head + await queued.read()
        await first.read()
    assert head.startswith(b": keep-alive\n\n")
    assert parse_sse(body)[-1] == "[DONE]"


async def test_a_slow_reader_gets_merged_deltas_while_the_engine_runs_on(engine) -> None:
    body = {"prompt": "x", "max_tokens": 30, **STREAM}
    async with serving(engine) as (url, app), aiohttp.ClientSession() as session:
        _, events = OpenAIRoutes(app[STATE]).open_stream("completions", body)
        first = await anext(events)
        deadline = time.monotonic() + 10
        while engine.core_client.core.scheduler.has_unfinished_requests():  # nobody reads meanwhile
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        rest = [orjson.loads(event.data) async for _, event in events if event != DONE]
        first = orjson.loads(first[1].data)
        whole = {**body, "stream": False}
        async with session.post(f"{url}/v1/completions", json=whole) as response:
            expected = (await response.json())["choices"][0]["text"]
    assert len(rest) <= 3  # a prefetched delta, one merged delta, the finish: not 29 deltas
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in [first, *rest]) == expected


async def test_a_dropped_stream_is_aborted_within_a_step(engine, monkeypatch) -> None:
    steps = []
    slow_down(engine, monkeypatch, 0.02)
    real_execute = engine.core_client.core.executor.model_runner.execute_model
    monkeypatch.setattr(
        engine.core_client.core.executor.model_runner,
        "execute_model",
        lambda out: steps.append(1) or real_execute(out),
    )
    body = {"prompt": "x", "max_tokens": 400, **STREAM}
    async with serving(engine) as (url, _), aiohttp.ClientSession() as session:
        response = await session.post(f"{url}/v1/completions", json=body)
        await response.content.readuntil(b"data: ")
        response.close()
        steps_at_drop = len(steps)
        await until(lambda: not engine.core_client.core.scheduler.has_unfinished_requests())
    assert len(steps) - steps_at_drop <= 2  # the step under way, at most one more
    assert engine.core_client.core.kv_cache_manager.usage == 0


async def test_a_dropped_non_streaming_request_is_aborted(engine, monkeypatch) -> None:
    slow_down(engine, monkeypatch, 0.02)
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True}
    async with serving(engine) as (url, _), aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(
                f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.3)
            )
        await until(lambda: not engine.core_client.core.scheduler.has_unfinished_requests())
    assert engine.core_client.core.kv_cache_manager.usage == 0


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_a_failed_step_ends_the_stream_with_an_error_event(engine, monkeypatch) -> None:
    slow_down(engine, monkeypatch, 0.0, fail_on_call=3)
    async with serving(engine) as (url, _), aiohttp.ClientSession() as session:
        body = {"prompt": "x", "max_tokens": 20, **STREAM}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
            events = parse_sse(await response.read())
        async with session.post(
            f"{url}/v1/completions", json={"prompt": "y", "max_tokens": 2}
        ) as r:
            assert r.status == (503 if engine.errored else 200)
    assert "choices" in events[0]
    assert set(events[-2]["error"]) == {"message", "type", "param", "code"}
    assert events[-1] == "[DONE]"


async def test_draining_refuses_new_requests_and_fails_health(engine) -> None:
    async with serving(engine) as (url, app), aiohttp.ClientSession() as session:
        app[STATE].draining = True
        async with session.get(f"{url}/health") as response:
            assert response.status == 503
        async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as response:
            assert response.status == 503
            assert (await response.json())["error"]["type"] == "service_unavailable"


async def test_each_app_has_its_own_metrics_registry(engine) -> None:
    first, second = build_app(engine), build_app(engine)
    assert first[STATE].metrics.registry is not second[STATE].metrics.registry
    first[STATE].metrics.generation_tokens.inc(5)
    assert b"asyncllm:generation_tokens_total" in second[STATE].metrics.render()
    assert b'generation_tokens_total{model_name="' in first[STATE].metrics.render()


async def test_logprobs_minus_1_is_the_whole_vocabulary_within_max_logprobs(
    engine, tiny_model_dir
) -> None:
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    every = {**body, "logprobs": True, "top_logprobs": -1}
    async with (
        serving(engine) as (url, _),
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/chat/completions", json=every) as r,
    ):
        assert r.status == 400 and (await r.json())["error"]["param"] == "logprobs"
    vocab_size = engine.input_processor.vocab_size
    args = EngineArgs(
        model=str(tiny_model_dir), max_model_len=64, num_kv_blocks=64, max_logprobs=vocab_size
    )
    wide = AsyncLLM.from_engine_args(args)
    try:
        async with (
            serving(wide) as (url, _),
            aiohttp.ClientSession() as s,
            s.post(f"{url}/v1/chat/completions", json=every) as r,
        ):
            reply = await r.json()
    finally:
        await wide.shutdown()
    entry = reply["choices"][0]["logprobs"]["content"][0]
    assert len(entry["top_logprobs"]) == vocab_size
