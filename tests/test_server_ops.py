"""Operating the server: API key, path prefix, body and concurrency limits, access logs, and a
graceful SIGTERM. One real server process; the SIGTERM test stops it, so it runs last."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from test_server_support import ServerProcess, parse_sse, tiny_server_args

KEY = "s3cret-key"
PREFIX = "/llm"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    flags = (
        "--api-key", KEY,
        "--root-path", PREFIX,
        "--max-request-body-bytes", "4096",
        "--max-concurrent-requests", "2",
        "--shutdown-timeout", "20",
    )  # fmt: skip
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir, *flags))
    yield process.start()
    process.stop()


def url(server: ServerProcess, path: str) -> str:
    return f"{server.url}{PREFIX}{path}"


async def test_api_key_guards_everything_but_health_and_metrics(server) -> None:
    async with aiohttp.ClientSession() as session:
        for path in ("/health", "/metrics"):
            async with session.get(url(server, path)) as response:
                assert response.status == 200, path
        async with session.get(url(server, "/v1/models")) as response:
            assert response.status == 401
            assert (await response.json())["error"]["code"] == "invalid_api_key"
        wrong = {"Authorization": f"Bearer {KEY}x"}
        async with session.get(url(server, "/v1/models"), headers=wrong) as response:
            assert response.status == 401
        async with session.get(url(server, "/v1/models"), headers=AUTH) as response:
            assert response.status == 200


def test_sdk_works_under_the_root_path_with_the_key(server) -> None:
    client = openai.OpenAI(base_url=url(server, "/v1"), api_key=KEY, max_retries=0)
    reply = client.completions.create(
        model=client.models.list().data[0].id, prompt="x", max_tokens=2
    )
    assert reply.choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url(server, "/v1"), api_key="nope", max_retries=0).models.list()


async def test_routes_live_under_the_prefix_and_without_it_both_guarded(server) -> None:
    async with aiohttp.ClientSession() as session:
        for path in (url(server, "/v1/models"), f"{server.url}/v1/models"):
            async with session.get(path) as response:
                assert response.status == 401, path
            async with session.get(path, headers=AUTH) as response:
                assert response.status == 200, path
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 200
    stripped = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    model = stripped.models.list().data[0].id
    assert stripped.completions.create(model=model, prompt="x", max_tokens=1).choices


async def test_body_over_the_limit_is_413(server) -> None:
    body = {"prompt": "x" * 5000, "max_tokens": 1}
    async with (
        aiohttp.ClientSession(headers=AUTH) as session,
        session.post(url(server, "/v1/completions"), json=body) as response,
    ):
        assert response.status == 413
        assert (await response.json())["error"]["code"] == "request_too_large"


async def test_requests_over_the_concurrency_limit_get_429(server) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as session:
        streams = [
            await session.post(url(server, "/v1/completions"), json={"prompt": f"{i}", **LONG})
            for i in range(2)
        ]
        for stream in streams:
            await stream.content.readuntil(b"\n\n")
        async with session.post(url(server, "/v1/completions"), json={"prompt": "x"}) as third:
            assert third.status == 429
            assert (await third.json())["error"]["type"] == "rate_limit_exceeded"
        for stream in streams:
            stream.close()
        for _ in range(100):  # the dropped streams leave the count
            async with session.post(url(server, "/v1/completions"), json={"prompt": "x", "max_tokens": 1}) as r:  # fmt: skip
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert r.status == 200


async def test_access_log_lines_carry_request_ids(server) -> None:
    async with (
        aiohttp.ClientSession(headers={**AUTH, "X-Request-Id": "trace-123"}) as session,
        session.get(url(server, "/v1/models")) as response,
    ):
        assert response.headers["X-Request-Id"] == "trace-123"
    await asyncio.sleep(0.2)
    entry = next(e for e in access_entries(server) if e["request_id"] == "trace-123")
    assert entry["path"] == f"{PREFIX}/v1/models" and entry["status"] == 200


def access_entries(server: ServerProcess) -> list[dict]:
    lines = [line for line in server.log().splitlines() if "asyncllm.access" in line]
    return [json.loads(line[line.index("{") :]) for line in lines]


async def test_a_dropped_stream_leaves_one_499_line(server) -> None:
    headers = {**AUTH, "X-Request-Id": "dropped-1"}
    async with aiohttp.ClientSession(headers=headers) as session:
        response = await session.post(url(server, "/v1/completions"), json={"prompt": "x", **LONG})
        await response.content.readuntil(b"\n\n")
        response.close()  # the client goes away mid-stream
    for _ in range(100):
        entries = [e for e in access_entries(server) if e["request_id"] == "dropped-1"]
        if entries:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # a second line would have come by now
    entries = [e for e in access_entries(server) if e["request_id"] == "dropped-1"]
    assert [e["status"] for e in entries] == [499]


async def test_health_and_metrics_polls_log_at_debug_only(server) -> None:
    headers = {"X-Request-Id": "poll-1"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for path in ("/health", "/metrics"):
            async with session.get(url(server, path)) as response:
                assert response.status == 200
    await asyncio.sleep(0.2)
    assert not [e for e in access_entries(server) if e["request_id"] == "poll-1"]


async def test_sigterm_lets_in_flight_streams_finish_then_exits_0(server) -> None:
    body = {"prompt": "last words", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with (
        aiohttp.ClientSession(headers=AUTH) as session,
        session.post(url(server, "/v1/completions"), json=body) as response,
    ):
        first = await response.content.readuntil(b"\n\n")
        server.terminate()
        assert await refuses_new_connections(server)
        rest = await response.read()
    events = parse_sse(first + rest)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert await asyncio.to_thread(server.process.wait, 30) == 0


async def refuses_new_connections(server: ServerProcess, timeout: float = 5.0) -> bool:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(int(timeout / 0.02)):
            try:
                async with session.get(url(server, "/health")):
                    pass
            except aiohttp.ClientConnectorError:
                return True
            await asyncio.sleep(0.02)
    return False
