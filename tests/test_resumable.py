"""Resumable streams through examples/nginx.conf: a stream cut mid-way and resumed with
Last-Event-ID is the uninterrupted stream, event for event; nobody reading for the retention
window cancels it and frees its blocks."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest
from conftest import save_tiny_llama
from test_server_nginx import NGINX, proxy  # noqa: F401 (the nginx fixture, on this server)
from test_server_support import ServerProcess, parse_metrics, sse_fields, tiny_server_args

pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (nginx-light)")

PREFIX = "/llm"
RETENTION_S = 3.0
# Long enough that no machine generates it within the retention window: the unread stream must
# still be running when the window ends.
UNREAD_MAX_TOKENS = 16_000
GREEDY = {"temperature": 0, "max_tokens": 60, "ignore_eos": True, "stream": True}
RESUMABLE = {**GREEDY, "stream_options": {"resumable": True}}
BODIES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}]}),
    "completions": ("/v1/completions", {"prompt": "Once upon a time"}),
}


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    model_dir = save_tiny_llama(
        tmp_path_factory.mktemp("long-llama"), default_model_dir, 49152, 16_384
    )
    log = tmp_path_factory.mktemp("server") / "server.log"
    store = f"sqlite:///{log.parent / 'responses.sqlite3'}"
    extra = (
        "--root-path",
        PREFIX,
        "--stream-retention",
        str(RETENTION_S),
        "--max-model-len",
        "16384",
    )
    process = ServerProcess(log, *tiny_server_args(model_dir, *extra, "--response-store", store))
    yield process.start()
    process.stop()


async def read_events(response: aiohttp.ClientResponse, limit: int | None = None) -> list[dict]:
    """SSE events as their fields, until the stream ends or `limit` events came."""
    events = []
    while limit is None or len(events) < limit:
        block = await response.content.readuntil(b"\n\n")
        if not block.endswith(b"\n\n"):
            break  # the end of the stream
        fields = sse_fields(block.decode().strip("\n"))
        if "data" in fields:
            events.append(fields)
    return events


def text_of(events: list[dict]) -> str:
    text = []
    for event in events:
        if event["data"] == "[DONE]":
            continue
        choice = orjson.loads(event["data"])["choices"][0]
        text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text)


def stream_id_of(events: list[dict]) -> str:
    return orjson.loads(events[0]["data"])["id"]


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as response:
        return parse_metrics(await response.text())


async def until_idle(session, url: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = await metrics(session, url)
        if values["asyncllm:num_requests_running"] == 0 or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("route", sorted(BODIES))
async def test_a_cut_stream_resumed_is_the_uninterrupted_stream(proxy, route) -> None:  # noqa: F811
    path, body = BODIES[route]
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy}{path}", json={**body, **GREEDY}) as response:
            whole = await read_events(response)
        response = await session.post(f"{proxy}{path}", json={**body, **RESUMABLE})
        head = await read_events(response, limit=5)
        response.close()  # the client's socket closes mid-stream; nginx drops the upstream
        headers = {"Last-Event-ID": head[-1]["id"]}
        resumed_url = f"{proxy}/v1/streams/{stream_id_of(head)}"
        async with session.get(resumed_url, headers=headers) as response:
            assert response.status == 200
            tail = await read_events(response)
    assert [e["id"] for e in head + tail] == [str(i) for i in range(len(whole))]
    assert text_of(head + tail) == text_of(whole) and len(text_of(whole)) > 0
    assert tail[-1]["data"] == "[DONE]"


async def test_a_cut_background_response_resumed_is_the_uninterrupted_one(proxy) -> None:  # noqa: F811
    body = {"input": "Tell a story.", "temperature": 0, "max_output_tokens": 60, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy}/v1/responses", json=body) as response:
            whole = await read_events(response)
        background = {**body, "background": True}
        response = await session.post(f"{proxy}/v1/responses", json=background)
        head = await read_events(response, limit=6)
        response.close()
        response_id = orjson.loads(head[0]["data"])["response"]["id"]
        url = f"{proxy}/v1/responses/{response_id}"
        headers = {"Last-Event-ID": head[-1]["id"]}
        async with session.get(url, params={"stream": "true"}, headers=headers) as response:
            tail = await read_events(response)
    events = [orjson.loads(e["data"]) for e in head + tail]
    assert [e["sequence_number"] for e in events] == [int(e["id"]) for e in head + tail]
    assert [e["sequence_number"] for e in events] == list(range(len(whole)))
    assert [e["type"] for e in events] == [e["event"] for e in whole]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    expected = [orjson.loads(e["data"]) for e in whole]
    assert "".join(deltas) == "".join(e.get("delta", "") for e in expected) != ""


async def test_starting_after_replays_a_finished_stream(proxy) -> None:  # noqa: F811
    path, body = BODIES["completions"]
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy}{path}", json={**body, **RESUMABLE}) as response:
            whole = await read_events(response)
        url = f"{proxy}/v1/streams/{stream_id_of(whole)}"
        async with session.get(url, params={"starting_after": "9"}) as response:
            tail = await read_events(response)
        async with session.get(url) as response:
            again = await read_events(response)
    assert tail == whole[10:]
    assert again == whole


async def test_a_stream_nobody_reads_is_cancelled_after_the_retention(server, proxy) -> None:  # noqa: F811
    body = {"prompt": "go", "stream": True, "max_tokens": UNREAD_MAX_TOKENS, "ignore_eos": True}
    body["stream_options"] = {"resumable": True}
    async with aiohttp.ClientSession() as session:
        idle = await until_idle(session, server.url)
        response = await session.post(f"{proxy}/v1/completions", json=body)
        head = await read_events(response, limit=2)
        response.close()
        cut_at = time.monotonic()
        await asyncio.sleep(RETENTION_S / 2)
        assert (await metrics(session, server.url))["asyncllm:num_requests_running"] == 1
        after = await until_idle(session, server.url)
        stopped_after = time.monotonic() - cut_at
        async with session.get(f"{proxy}/v1/streams/{stream_id_of(head)}") as gone:
            status = gone.status
    assert stopped_after >= RETENTION_S
    assert after["asyncllm:kv_cache_usage_perc"] == idle["asyncllm:kv_cache_usage_perc"]
    generated = after["asyncllm:generation_tokens_total"] - idle["asyncllm:generation_tokens_total"]
    assert generated < body["max_tokens"]  # cancelled, not run to the end
    assert status == 404


async def test_a_finished_stream_frees_its_blocks_and_expires(server, proxy) -> None:  # noqa: F811
    path, body = BODIES["chat"]
    async with aiohttp.ClientSession() as session:
        idle = await until_idle(session, server.url)
        response = await session.post(f"{proxy}{path}", json={**body, **RESUMABLE})
        head = await read_events(response, limit=1)
        response.close()
        after = await until_idle(session, server.url)
        url = f"{proxy}/v1/streams/{stream_id_of(head)}"
        async with session.get(url) as kept:
            replayed = await read_events(kept)
        await asyncio.sleep(RETENTION_S + 0.5)
        async with session.get(url) as expired:
            error = await expired.json()
    assert after["asyncllm:kv_cache_usage_perc"] == idle["asyncllm:kv_cache_usage_perc"]
    assert replayed[-1]["data"] == "[DONE]"
    assert expired.status == 404 and error["error"]["code"] == "stream_not_found"


async def test_bad_resumptions_are_refused_clearly(proxy) -> None:  # noqa: F811
    path, body = BODIES["completions"]
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy}{path}", json={**body, **RESUMABLE}) as response:
            resumable = stream_id_of(await read_events(response))
        async with session.post(f"{proxy}{path}", json={**body, **GREEDY}) as response:
            plain = stream_id_of(await read_events(response))
        answers = {}
        cases = {
            "malformed": (resumable, {"Last-Event-ID": "seven"}),
            "negative": (resumable, {"Last-Event-ID": "-1"}),
            "past the end": (resumable, {"Last-Event-ID": "100000"}),
            "unknown": ("cmpl-nope", {}),
            "not resumable": (plain, {}),
        }
        for case, (stream_id, headers) in cases.items():
            async with session.get(f"{proxy}/v1/streams/{stream_id}", headers=headers) as r:
                answers[case] = (r.status, (await r.json())["error"])
    assert answers["malformed"][0] == 400 and answers["malformed"][1]["param"] == "Last-Event-ID"
    assert answers["negative"][0] == 400
    assert (
        answers["past the end"][0] == 400
        and "another stream" in answers["past the end"][1]["message"]
    )
    assert answers["unknown"][0] == 404 and answers["not resumable"][0] == 404


async def test_a_websocket_stream_resumes_on_a_new_socket(proxy) -> None:  # noqa: F811
    _, body = BODIES["completions"]
    request = {"id": "r", "body": {**body, **RESUMABLE}}
    plain = {"id": "p", "body": {**body, **GREEDY}}
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{proxy}/v1/stream") as ws:
            await ws.send_json(plain)
            whole = await receive_until_done(ws)
        async with session.ws_connect(f"{proxy}/v1/stream") as ws:
            await ws.send_json(request)
            head = [await ws.receive_json(timeout=20) for _ in range(4)]
        # the socket closed: a resumable request keeps running
        resume = {"type": "resume", "id": "again", "stream": head[0]["data"]["id"]}
        resume["starting_after"] = head[-1]["event_id"]
        async with session.ws_connect(f"{proxy}/v1/stream") as ws:
            await ws.send_json(resume)
            tail = await receive_until_done(ws)
    texts = [f["data"]["choices"][0]["text"] for f in head + tail if f["type"] == "chunk"]
    expected = [f["data"]["choices"][0]["text"] for f in whole if f["type"] == "chunk"]
    assert "".join(texts) == "".join(expected)
    assert [f["event_id"] for f in head + tail if f["type"] == "chunk"] == list(
        range(len(expected))
    )


async def receive_until_done(ws) -> list[dict]:
    frames = [await ws.receive_json(timeout=20)]
    while frames[-1]["type"] != "done":
        frames.append(await ws.receive_json(timeout=20))
    return frames


async def test_cancelling_a_resumable_websocket_request_ends_it_at_once(server, proxy) -> None:  # noqa: F811
    body = {"prompt": "go", "max_tokens": 440, "ignore_eos": True}
    body["stream_options"] = {"resumable": True}
    async with aiohttp.ClientSession() as session:
        idle = await until_idle(session, server.url)
        async with session.ws_connect(f"{proxy}/v1/stream") as ws:
            await ws.send_json({"id": "c", "body": body})
            first = await ws.receive_json(timeout=20)
            await ws.send_json({"type": "cancel", "id": "c"})
            frames = await receive_until_done(ws)
        after = await until_idle(session, server.url, timeout=RETENTION_S / 2)
        async with session.get(f"{proxy}/v1/streams/{first['data']['id']}") as kept:
            replayed = await read_events(kept)
    assert frames[-1] == {"type": "done", "id": "c", "cancelled": True}
    assert after["asyncllm:num_requests_running"] == 0  # well before the retention ran out
    assert after["asyncllm:kv_cache_usage_perc"] == idle["asyncllm:kv_cache_usage_perc"]
    assert 0 < len(replayed) < body["max_tokens"]  # what it sent before the cancel stays readable
