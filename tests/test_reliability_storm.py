"""Load, disconnect storms and graceful shutdown against real server processes.

500 concurrent streams from the openai SDK, a third of them dropped at random points: after
the storm nothing runs or waits, the KV cache is back to idle, the server's RSS is within 3%
of where it stood after a warm-up storm, and every completed stream is well formed. SIGTERM
during 50 live streams: new connections are refused, the streams finish (or, past the
shutdown timeout, end with an error event), and the process exits 0."""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp
import openai
import pytest
from test_reliability_support import is_openai_error, report, rss_kib
from test_server_ops import refuses_new_connections
from test_server_support import ServerProcess, parse_metrics, parse_sse, tiny_server_args

STREAMS = 500
MAX_TOKENS = 12
STORM_BOUND_S = 240.0  # the whole storm, or the test fails rather than hang
# storms measured after the warm-up one ($ASYNCLLM_STORMS, to look for growth storm after storm)
STORMS = int(os.environ.get("ASYNCLLM_STORMS", "1"))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("storm") / "server.log"
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir)).start()
    yield process
    process.stop()


async def one_stream(
    client: openai.AsyncOpenAI, model: str, index: int, drop_after: int | None
) -> str:
    """'completed' (checked well formed) or 'dropped' (closed after drop_after chunks)."""
    stream = await client.completions.create(
        model=model,
        prompt=f"storm request {index}",
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = []
    async with stream:
        async for chunk in stream:
            if drop_after is not None and len(chunks) >= drop_after:
                return "dropped"  # leaving the block closes the connection mid-stream
            chunks.append(chunk)
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    return "completed"


async def dropped_in_time(stream, seconds: float) -> str:
    try:
        return await asyncio.wait_for(stream, seconds)
    except asyncio.TimeoutError:
        return "dropped"  # cancelled wherever it was: connecting, queued, or mid-stream


async def storm(client: openai.AsyncOpenAI, model: str, seed: int) -> dict[str, int]:
    """A third of the streams drop: half after 0-2 chunks (a stream has at least 3), half
    after a random 0-0.5 s."""
    rng = random.Random(seed)
    tasks = []
    for i in range(STREAMS):
        if i % 6 == 0:
            tasks.append(one_stream(client, model, i, rng.randint(0, 2)))
        elif i % 6 == 3:
            tasks.append(dropped_in_time(one_stream(client, model, i, None), rng.random() / 2))
        else:
            tasks.append(one_stream(client, model, i, None))
    results = await asyncio.wait_for(asyncio.gather(*tasks), STORM_BOUND_S)
    return {kind: results.count(kind) for kind in ("completed", "dropped")}


async def idle_metrics(server: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{server.url}/metrics") as response:
                metrics = parse_metrics(await response.text())
            idle = metrics["asyncllm:num_requests_running"] == 0
            idle = idle and metrics["asyncllm:num_requests_waiting"] == 0
            if idle and metrics["asyncllm:kv_cache_usage_perc"] == 0:
                return metrics
            assert time.monotonic() < deadline, metrics
            await asyncio.sleep(0.1)


async def test_a_disconnect_storm_leaves_nothing_behind(server) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    assert server.url.startswith("http://127.0.0.1:")  # the default bind
    pid = server.process.pid
    await idle_metrics(server)
    warm_up = await storm(client, model, seed=1)
    await idle_metrics(server)
    rss_before = rss_kib(pid)
    start = time.monotonic()
    runs, rss_after_each = [warm_up], []
    for seed in range(2, 2 + STORMS):
        runs.append(await storm(client, model, seed=seed))
        await idle_metrics(server)
        await asyncio.sleep(0.5)
        rss_after_each.append(round(rss_kib(pid) / 1024, 1))
    elapsed = (time.monotonic() - start) / STORMS
    rss_after = rss_kib(pid)
    await client.close()
    counts = runs[-1]
    report(
        "storm",
        streams=STREAMS,
        completed=counts["completed"],
        dropped=counts["dropped"],
        seconds=elapsed,
        rss_before_mib=rss_before / 1024,
        rss_after_mib=rss_after / 1024,
        rss_change_pct=100 * (rss_after - rss_before) / rss_before,
        storms=STORMS,
        rss_after_each_mib=rss_after_each,
    )
    for run in runs:
        assert run["completed"] + run["dropped"] == STREAMS
        assert run["dropped"] >= STREAMS // 6  # the chunk-count drops at least
    assert abs(rss_after - rss_before) <= 0.03 * rss_before
    async with aiohttp.ClientSession() as session, session.get(f"{server.url}/health") as r:
        assert r.status == 200


# -- graceful shutdown ---------------------------------------------------------------------

LIVE = 50


async def open_streams(server: ServerProcess, session, max_tokens: int) -> list:
    body = {"max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    responses = await asyncio.gather(
        *(
            session.post(f"{server.url}/v1/completions", json={"prompt": f"live {i}", **body})
            for i in range(LIVE)
        )
    )
    heads = [await r.content.readuntil(b"\n\n") for r in responses]
    return list(zip(responses, heads))


async def sigterm_during_live_streams(server: ServerProcess, max_tokens: int) -> list[list]:
    """SIGTERM once all streams have started; returns their events, checks the exit code."""
    connector = aiohttp.TCPConnector(limit=LIVE)
    async with aiohttp.ClientSession(connector=connector) as session:
        streams = await open_streams(server, session, max_tokens)
        server.terminate()
        assert await refuses_new_connections(server)
        bodies = await asyncio.wait_for(
            asyncio.gather(*(r.read() for r, _ in streams)), STORM_BOUND_S
        )
    events = [parse_sse(head + body) for (_, head), body in zip(streams, bodies)]
    assert await asyncio.to_thread(server.process.wait, 60) == 0
    return events


def start_server(tiny_model_dir, tmp_path, *flags: str) -> ServerProcess:
    log = tmp_path / "server.log"
    return ServerProcess(log, *tiny_server_args(tiny_model_dir, *flags)).start()


async def test_sigterm_lets_50_live_streams_finish_and_exits_0(tiny_model_dir, tmp_path) -> None:
    server = start_server(tiny_model_dir, tmp_path, "--shutdown-timeout", "60")
    try:
        start = time.monotonic()
        events = await sigterm_during_live_streams(server, max_tokens=40)
        report("sigterm drain", streams=LIVE, seconds=time.monotonic() - start)
    finally:
        server.stop()
    for stream in events:
        assert stream[-1] == "[DONE]"
        assert stream[-2]["choices"][0]["finish_reason"] == "length"
    assert "leaked" not in server.log_path.read_text()  # frozen start-up objects thawed at exit


async def test_sigterm_past_the_timeout_ends_streams_with_an_error(tiny_model_dir, tmp_path) -> None:  # fmt: skip
    server = start_server(tiny_model_dir, tmp_path, "--shutdown-timeout", "0.2")
    try:
        start = time.monotonic()
        events = await sigterm_during_live_streams(server, max_tokens=480)
        elapsed = time.monotonic() - start
    finally:
        server.stop()
    ended = [s for s in events if s[-1] == "[DONE]" and is_openai_error(s[-2])]
    finished = [s for s in events if s[-1] == "[DONE]" and "choices" in s[-2]]
    report("sigterm timeout", streams=LIVE, ended_with_error=len(ended), seconds=elapsed)
    assert len(ended) + len(finished) == LIVE
    assert ended and all(s[-2]["error"]["type"] == "service_unavailable" for s in ended)
