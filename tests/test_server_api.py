"""The server as a client sees it: a real `python -m asyncllm.serve` on a real port, driven by
the official openai SDK, raw HTTP, and a WebSocket client."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import orjson
import pytest
from test_server_support import (
    ServerProcess,
    parse_metrics,
    parse_sse,
    sse_fields,
    tiny_server_args,
)

LONG = {"max_tokens": 400, "ignore_eos": True}
JSON = {"Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir, "--served-model-name", "tiny"))
    yield process.start()
    process.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


async def metrics(session: aiohttp.ClientSession, server: ServerProcess) -> dict[str, float]:
    async with session.get(f"{server.url}/metrics") as response:
        return parse_metrics(await response.text())


async def until_idle(session, server, timeout: float = 10.0) -> dict[str, float]:
    """Polls /metrics until nothing runs or waits; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        values = await metrics(session, server)
        idle = values["asyncllm:num_requests_running"] == 0
        idle = idle and values["asyncllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.05)


# -- endpoints -----------------------------------------------------------------------------


async def test_health_version_and_models(server, tiny_model_dir) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 200
        async with session.get(f"{server.url}/version") as response:
            assert "version" in await response.json()
        async with session.get(f"{server.url}/v1/models") as response:
            models = await response.json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == 512
    assert card["root"] == str(tiny_model_dir)  # the --model argument as given
    assert card["owned_by"] == "asyncllm" and 0 < card["created"] <= time.time()


async def test_tokenize_then_detokenize_round_trips(server) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/tokenize", json={"prompt": "hello world"}) as r:
            tokenized = await r.json()
        async with session.post(
            f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}
        ) as r:
            detokenized = await r.json()
        chat = {"messages": CHAT}
        async with session.post(f"{server.url}/tokenize", json=chat) as r:
            chat_tokens = await r.json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    assert detokenized["prompt"] == "hello world"
    assert chat_tokens["count"] > tokenized["count"]  # the chat template adds its markup


# -- the openai SDK ------------------------------------------------------------------------


def test_sdk_sync_completion(client) -> None:
    completion = client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = completion.choices[0]
    assert completion.object == "text_completion" and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 5 and choice.text


def test_sdk_sync_chat_matches_its_stream(client) -> None:
    kwargs = {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0}
    full = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(
        **kwargs,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == full.choices[0].message.content
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


async def test_sdk_async_streaming_completion(async_client) -> None:
    stream = await async_client.completions.create(
        model="tiny", prompt="abc", max_tokens=6, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "text_completion" for c in chunks)


async def test_sdk_async_batch_prompts_get_one_choice_each(async_client) -> None:
    texts = await async_client.completions.create(
        model="tiny", prompt=["one", "two", "three"], max_tokens=3, temperature=0
    )
    token_ids = await async_client.completions.create(
        model="tiny", prompt=[[1, 2, 3], [4, 5]], max_tokens=3, temperature=0
    )
    assert sorted(c.index for c in texts.choices) == [0, 1, 2]
    assert sorted(c.index for c in token_ids.choices) == [0, 1]
    assert token_ids.usage.prompt_tokens == 5


def test_sdk_chat_with_n_and_logprobs(client) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=3, n=2, logprobs=True, top_logprobs=2, seed=1
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    for choice in reply.choices:
        tokens = choice.logprobs.content
        assert len(tokens) == 3 and all(2 <= len(t.top_logprobs) <= 3 for t in tokens)  # + sampled
        assert "".join(t.token for t in tokens) == choice.message.content
    assert reply.usage.completion_tokens == 6


def test_sdk_completion_logprobs(client) -> None:
    reply = client.completions.create(model="tiny", prompt="hi", max_tokens=4, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(3 <= len(top) <= 4 for top in logprobs.top_logprobs)  # the top 3 + the sampled
    assert logprobs.text_offset[0] == 0


def test_sdk_raises_typed_errors(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt=[5] * 600)
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.param == "prompt"
    long_chat = [{"role": "user", "content": "hello " * 600}]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="tiny", messages=long_chat)
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.param == "messages"


def test_sdk_retrieves_the_model_by_id(client) -> None:
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.owned_by == "asyncllm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_sdk_raises_bad_request_for_missing_fields_and_wrong_types(client) -> None:
    with pytest.raises(openai.BadRequestError) as empty:
        client.completions.create(model="tiny", prompt=[])
    assert empty.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as wrong_type:
        client.completions.create(model="tiny", prompt="x", extra_body={"top_k": "many"})
    assert (wrong_type.value.code, wrong_type.value.body["param"]) == ("invalid_type", "top_k")
    with pytest.raises(openai.BadRequestError) as missing:
        client.chat.completions.create(model="tiny", messages=None)
    assert missing.value.code == "missing_required_parameter"


# -- logprobs -------------------------------------------------------------------------------


async def post_json(server: ServerProcess, path: str, body: dict) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}{path}", json=body) as response,
    ):
        return response.status, await response.json()


def test_logprobs_0_still_holds_the_sampled_token(client) -> None:
    reply = client.completions.create(model="tiny", prompt="hi", max_tokens=5, logprobs=0)
    logprobs = reply.choices[0].logprobs
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top == {token: logprob}


def test_top_logprobs_hold_the_top_n_plus_the_sampled_token(client) -> None:
    hot = {"temperature": 5.0, "seed": 3, "max_tokens": 24}
    reply = client.completions.create(model="tiny", prompt="hi", logprobs=1, **hot)
    logprobs = reply.choices[0].logprobs
    outside_top_1 = 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == logprob and 1 <= len(top) <= 2
        outside_top_1 += len(top) == 2
        assert max(top.values()) >= logprob
    assert outside_top_1 > 0  # at this temperature most sampled tokens are not the top one
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, logprobs=True, top_logprobs=1, **hot
    )
    for entry in chat.choices[0].logprobs.content:
        alternatives = {t.token: t.logprob for t in entry.top_logprobs}
        assert alternatives[entry.token] == entry.logprob and 1 <= len(alternatives) <= 2


def check_echoed_logprobs(text: str, logprobs: dict, num_tokens: int) -> None:
    assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == num_tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert text[offset : offset + len(token)] == token


async def test_echo_with_logprobs_covers_the_prompt_and_the_output(server) -> None:
    body = {"prompt": "Hello world, this is", "max_tokens": 4, "ignore_eos": True, "logprobs": 2}
    status, reply = await post_json(server, "/v1/completions", {**body, "echo": True})
    assert status == 200
    choice, usage = reply["choices"][0], reply["usage"]
    assert choice["text"].startswith("Hello world, this is")
    check_echoed_logprobs(choice["text"], choice["logprobs"], usage["total_tokens"])
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{server.url}/v1/completions", json={**body, "echo": True, "stream": True}
        ) as r,
    ):
        chunks = [e for e in parse_sse(await r.read()) if e != "[DONE]"]
    merged: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for chunk in chunks:
        for name, values in (chunk["choices"][0]["logprobs"] or {}).items():
            merged[name] += values
    text = "".join(c["choices"][0]["text"] for c in chunks)
    check_echoed_logprobs(text, merged, usage["total_tokens"])


async def test_max_tokens_0_with_echo_scores_the_prompt(server) -> None:
    body = {"prompt": "Hello world", "max_tokens": 0, "echo": True, "logprobs": 1}
    status, reply = await post_json(server, "/v1/completions", body)
    assert status == 200
    choice, usage = reply["choices"][0], reply["usage"]
    assert choice["text"] == "Hello world" and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0
    check_echoed_logprobs(choice["text"], choice["logprobs"], usage["prompt_tokens"])
    status, error = await post_json(server, "/v1/completions", {**body, "echo": False})
    assert status == 400 and error["error"]["param"] == "max_tokens"


def check_prompt_logprobs(prompt_logprobs: list, prompt_token_ids: list[int], top: int) -> None:
    assert len(prompt_logprobs) == len(prompt_token_ids) and prompt_logprobs[0] is None
    for token_id, entry in zip(prompt_token_ids[1:], prompt_logprobs[1:]):
        assert str(token_id) in entry and 1 <= len(entry) <= top + 1
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())


async def test_prompt_logprobs_are_returned_in_each_choice(server) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/tokenize", json={"prompt": "The sky is"}) as r:
            prompt_ids = (await r.json())["tokens"]
        async with session.post(f"{server.url}/tokenize", json={"messages": CHAT}) as r:
            chat_ids = (await r.json())["tokens"]
    body = {"prompt": "The sky is", "max_tokens": 2, "prompt_logprobs": 2, "n": 2}
    status, reply = await post_json(server, "/v1/completions", body)
    assert status == 200 and len(reply["choices"]) == 2
    for choice in reply["choices"]:
        check_prompt_logprobs(choice["prompt_logprobs"], prompt_ids, 2)
    chat = {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 1}
    status, reply = await post_json(server, "/v1/chat/completions", chat)
    check_prompt_logprobs(reply["choices"][0]["prompt_logprobs"], chat_ids, 1)
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}/v1/completions", json={**body, "stream": True}) as r,
    ):
        chunks = [e for e in parse_sse(await r.read()) if e != "[DONE]"]
    for index in (0, 1):
        first = next(c["choices"][0] for c in chunks if c["choices"][0]["index"] == index)
        check_prompt_logprobs(first["prompt_logprobs"], prompt_ids, 2)


# -- what OpenAI and vLLM answer -----------------------------------------------------------


async def test_stream_options_without_stream_are_refused(server) -> None:
    body = {"prompt": "x", "max_tokens": 1, "stream_options": {"include_usage": True}}
    status, error = await post_json(server, "/v1/completions", body)
    assert status == 400 and error["error"]["param"] == "stream_options"
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}/v1/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status == 200 and parse_sse(await r.read())[-1] == "[DONE]"


@pytest.mark.parametrize(
    ("seed", "status"),
    [(-(2**63), 200), (2**63 - 1, 200), (-(2**63) - 1, 400), (2**63, 400), (2**64, 400)],
)
async def test_seed_takes_exactly_the_int64_range(server, seed, status) -> None:
    body = {"prompt": "x", "max_tokens": 1, "seed": seed}
    answer_status, answer = await post_json(server, "/v1/completions", body)
    assert answer_status == status
    if status == 400:
        assert answer["error"]["param"] == "seed" and "2^63" in answer["error"]["message"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
async def test_bodies_declared_as_anything_but_json_are_415(server, content_type) -> None:
    body = orjson.dumps({"prompt": "x", "max_tokens": 1})
    async with aiohttp.ClientSession() as session:
        for path in ("/v1/completions", "/tokenize"):
            headers = {"Content-Type": content_type}
            async with session.post(f"{server.url}{path}", data=body, headers=headers) as r:
                assert (
                    r.status == 415
                    and (await r.json())["error"]["code"] == "unsupported_media_type"
                )
        headers = {"Content-Type": "application/json; charset=utf-8"}
        async with session.post(f"{server.url}/v1/completions", data=body, headers=headers) as r:
            assert r.status == 200


async def test_max_tokens_beyond_the_context_left_is_refused(server) -> None:
    prompt = [5] * 500  # of 512
    status, error = await post_json(server, "/v1/completions", {"prompt": prompt, "max_tokens": 13})
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["param"] == "max_tokens"
    assert all(str(n) in error["error"]["message"] for n in (512, 513, 500, 13))
    status, reply = await post_json(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12})
    assert status == 200
    status, reply = await post_json(server, "/v1/completions", {"prompt": prompt, "min_tokens": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] <= 12  # 16 clamped to the room
    chat = {"messages": [{"role": "user", "content": "hi " * 200}], "max_completion_tokens": 500}
    status, error = await post_json(server, "/v1/chat/completions", chat)
    assert status == 400 and error["error"]["param"] == "max_completion_tokens"


async def test_openapi_is_valid_and_documents_a_plain_get_of_the_websocket(server) -> None:
    from openapi_spec_validator import validate

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/openapi.json") as response:
            spec = await response.json()
        async with session.get(f"{server.url}/v1/stream") as response:
            status, error = response.status, await response.json()
    validate(spec)
    assert status == 400 and "error" in error
    assert "400" in spec["paths"]["/v1/stream"]["get"]["responses"]
    events = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert events["text/event-stream"]["x-event-data"]["$ref"].endswith("ChatCompletionChunk")


@pytest.mark.parametrize(
    "message",
    [
        {"role": "", "content": "hi"},
        {"role": ""},
        {"role": "user"},
        {"role": "user", "content": None},
    ],
)
async def test_chat_messages_need_a_role_and_content(server, message) -> None:
    status, error = await post_json(server, "/v1/chat/completions", {"messages": [message]})
    assert status == 400 and error["error"]["param"].startswith("messages[0].")


async def test_custom_roles_and_an_assistant_without_content_are_accepted(server) -> None:
    messages = [{"role": "narrator", "content": "Once."}, *CHAT, {"role": "assistant"}]
    status, _ = await post_json(
        server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}
    )
    assert status == 200


# -- vLLM's extensions ---------------------------------------------------------------------


async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "hi", "max_tokens": 5, "ignore_eos": True, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}/v1/completions", json={**body, "stream_options": options}) as r,
    ):
        chunks = [e for e in parse_sse(await r.read()) if e != "[DONE]"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks)


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(client) -> None:
    prompt = list(range(1000, 1100))
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 64


async def test_chat_echo_repeats_the_assistant_message_it_continues(server) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Hello there"}]
    body = {"messages": messages, "max_tokens": 3, "ignore_eos": True, "echo": True}
    status, reply = await post_json(server, "/v1/chat/completions", body)
    assert status == 200
    assert reply["choices"][0]["message"]["content"].startswith("Hello there")
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}) as r,
    ):
        chunks = [e for e in parse_sse(await r.read()) if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text.startswith("Hello there")
    _, plain = await post_json(server, "/v1/chat/completions", {**body, "messages": CHAT})
    assert not plain["choices"][0]["message"]["content"].startswith("Hello there")


OPEN_REPLY = [*CHAT, {"role": "assistant", "content": "Hello there"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


async def rendered(server, messages: list[dict], **options: bool) -> str:
    """The chat template's text for these messages, as /tokenize renders it."""
    _, tokens = await post_json(server, "/tokenize", {"messages": messages, **options})
    _, text = await post_json(server, "/detokenize", {"tokens": tokens["tokens"]})
    return text["prompt"]


async def test_continue_final_message_leaves_the_assistant_message_open(server) -> None:
    assert (await rendered(server, OPEN_REPLY, **CONTINUE)).endswith("Hello there")
    closed = await rendered(server, OPEN_REPLY)
    assert not closed.endswith("Hello there") and "Hello there<|im_end|>" in closed
    body = {"messages": OPEN_REPLY, "max_tokens": 2, "ignore_eos": True}
    _, continued = await post_json(server, "/v1/chat/completions", {**body, **CONTINUE})
    _, opened = await post_json(server, "/v1/chat/completions", body)
    _, tokens = await post_json(server, "/tokenize", {"messages": OPEN_REPLY, **CONTINUE})
    assert continued["usage"]["prompt_tokens"] == tokens["count"]
    assert opened["usage"]["prompt_tokens"] > tokens["count"]  # end of turn, a new opening


async def test_tokenize_counts_the_generation_prompt_only_when_asked(server) -> None:
    _, opened = await post_json(server, "/tokenize", {"messages": CHAT})
    body = {"messages": CHAT, "add_generation_prompt": False}
    _, plain = await post_json(server, "/tokenize", body)
    assert opened["tokens"][: plain["count"]] == plain["tokens"]
    assert opened["count"] > plain["count"]
    _, opening = await post_json(
        server, "/detokenize", {"tokens": opened["tokens"][plain["count"] :]}
    )
    assert "assistant" in opening["prompt"]
    assert not (await rendered(server, CHAT, add_generation_prompt=False)).endswith("assistant\n")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(
    ("messages", "options"),
    [
        (OPEN_REPLY, {"add_generation_prompt": True, "continue_final_message": True}),
        (OPEN_REPLY, {"continue_final_message": True}),  # add_generation_prompt defaults to true
        (CHAT, CONTINUE),  # no assistant message to continue
    ],
)
async def test_continue_final_message_is_refused_where_it_cannot_apply(
    server, path, messages, options
) -> None:
    status, error = await post_json(server, path, {"messages": messages, **options})
    assert status == 400 and error["error"]["param"] == "continue_final_message"


async def test_tokenize_returns_token_strings_when_asked(server) -> None:
    body = {"prompt": "hello world", "return_token_strs": True}
    status, reply = await post_json(server, "/tokenize", body)
    assert status == 200 and len(reply["token_strs"]) == reply["count"] > 0
    assert all(isinstance(t, str) and t for t in reply["token_strs"])
    _, plain = await post_json(server, "/tokenize", {"prompt": "hello world"})
    assert "token_strs" not in plain


# -- the wire format -----------------------------------------------------------------------


async def test_sse_wire_format_and_headers(server) -> None:
    body = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True, "stream": True, "echo": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}/v1/completions", json=body) as response,
    ):
        raw = await response.read()
        headers = response.headers
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["Cache-Control"] == "no-cache" and headers["X-Accel-Buffering"] == "no"
    assert "X-Request-Id" in headers
    events = parse_sse(raw)
    assert raw.endswith(b"data: [DONE]\nid: %d\n\n" % (len(events) - 1))  # every event numbered
    blocks = [b for b in raw.decode().split("\n\n") if b and not b.startswith(":")]
    ids = [sse_fields(block).get("id") for block in blocks]
    assert ids == [str(i) for i in range(len(events))]
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["text"].startswith("hi")  # echo
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_first_chunk_arrives_long_before_the_last(server) -> None:
    body = {"prompt": "count", "stream": True, **LONG}
    start = time.monotonic()
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}/v1/completions", json=body) as response,
    ):
        await response.content.readuntil(b"\n\n")
        first = time.monotonic() - start
        await response.read()
        last = time.monotonic() - start
    assert first < last / 4


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"max_tokens": 3}', 400, "prompt"),
        (b'{"prompt": "x", "max_tokens": "3"}', 400, "max_tokens"),
        (b'{"prompt": "x", "stop": 7}', 400, "stop"),
        (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
        (b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
        (b'{"prompt": [99999999]}', 400, "prompt_token_ids"),
    ],
)
async def test_bad_requests_get_the_openai_error_shape(server, body, status, param) -> None:
    async with aiohttp.ClientSession() as session:
        url = f"{server.url}/v1/completions"
        async with session.post(url, data=body, headers=JSON) as response:
            error = await response.json()
            assert response.status == status
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["param"] == param


async def test_unknown_fields_are_ignored_and_the_server_keeps_serving(server) -> None:
    body = {"prompt": "x", "max_tokens": 2, "frobnicate": {"a": 1}, "user": "me"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/v1/completions", json=body) as response:
            assert response.status == 200
        async with session.post(f"{server.url}/v1/chat/completions", json={"messages": 3}) as r:
            assert r.status == 400
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 200


# -- disconnects ---------------------------------------------------------------------------


async def test_hundred_streams_dropped_midway_free_everything(server) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        idle = await until_idle(session, server)

        async def drop_after_first_token(i: int) -> None:
            body = {"prompt": f"story {i}", "stream": True, **LONG}
            response = await session.post(f"{server.url}/v1/completions", json=body)
            while not (await response.content.readuntil(b"\n\n")).startswith(b"data: "):
                pass
            response.close()  # drops the connection mid-stream

        await asyncio.gather(*(drop_after_first_token(i) for i in range(100)))
        after = await until_idle(session, server, timeout=10)
    assert after["asyncllm:num_requests_running"] == 0
    assert after["asyncllm:num_requests_waiting"] == 0
    assert after["asyncllm:kv_cache_usage_perc"] == idle["asyncllm:kv_cache_usage_perc"]
    generated = after["asyncllm:generation_tokens_total"] - idle["asyncllm:generation_tokens_total"]
    assert generated < 100 * LONG["max_tokens"] / 4  # aborted, not run to the end


# -- WebSocket -----------------------------------------------------------------------------


async def test_websocket_multiplexes_requests_and_cancels_one(server) -> None:
    frames: dict[str, list[dict]] = {}
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{server.url}/v1/stream") as ws:
            await ws.send_str(orjson.dumps({"id": "chat", "endpoint": "chat", "body": {"messages": CHAT, "max_tokens": 5, "ignore_eos": True}}).decode())  # fmt: skip
            await ws.send_json({"id": "text", "body": {"prompt": "hi", "max_tokens": 7, "ignore_eos": True, "stream_options": {"include_usage": True}}})  # fmt: skip
            await ws.send_json({"id": "long", "body": {"prompt": "go", **LONG}})
            await ws.send_json({"id": "bad", "body": {"prompt": "x", "top_k": -5}})
            done: set[str] = set()
            while done != {"chat", "text", "long", "bad"} or frames["long"][-1]["type"] != "done":
                frame = await ws.receive_json(timeout=20)
                frames.setdefault(frame["id"], []).append(frame)
                if frame["type"] == "chunk" and frame["id"] == "long" and "long" not in done:
                    await ws.send_json({"type": "cancel", "id": "long"})
                    done.add("long")  # one cancel: a second one would be an unknown id's
                if frame["type"] == "done":
                    done.add(frame["id"])
        values = await until_idle(session, server)
    chat = [f["data"] for f in frames["chat"] if f["type"] == "chunk"]
    assert chat[0]["object"] == "chat.completion.chunk"
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[-1]["choices"][0]["finish_reason"] == "length"
    text = [f["data"] for f in frames["text"] if f["type"] == "chunk"]
    assert text[-1]["usage"]["completion_tokens"] == 7
    assert frames["long"][-1] == {"type": "done", "id": "long", "cancelled": True}
    assert [f["type"] for f in frames["bad"]] == ["error", "done"]
    assert frames["bad"][0]["error"]["param"] == "top_k"
    assert values["asyncllm:num_requests_running"] == 0


async def test_websocket_duplicate_id_and_unknown_cancel_get_errors(server) -> None:
    frames: list[dict] = []
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{server.url}/v1/stream") as ws,
    ):
        await ws.send_json({"id": "twice", "body": {"prompt": "go", **LONG}})
        await ws.send_json({"id": "twice", "body": {"prompt": "again", **LONG}})
        await ws.send_json({"type": "cancel", "id": "nobody"})
        while len([f for f in frames if f["type"] != "chunk"]) < 3:
            frames.append(await ws.receive_json(timeout=20))
        await ws.send_json({"type": "cancel", "id": "twice"})
        while frames[-1].get("cancelled") is not True:
            frames.append(await ws.receive_json(timeout=20))
    replies = [(f["type"], f["id"]) for f in frames if f["type"] != "chunk"]
    # frames are answered in order; the first "twice" keeps running until its cancel
    assert replies == [
        ("error", "twice"),
        ("done", "twice"),
        ("error", "nobody"),
        ("done", "twice"),
    ]
    errors = {f["id"]: f["error"] for f in frames if f["type"] == "error"}
    assert errors["twice"]["param"] == "id" and "in flight" in errors["twice"]["message"]
    assert errors["nobody"]["param"] == "id"


async def test_closing_the_websocket_aborts_its_requests(server) -> None:
    async with aiohttp.ClientSession() as session:
        idle = await until_idle(session, server)
        async with session.ws_connect(f"{server.url}/v1/stream") as ws:
            for i in range(8):
                await ws.send_json({"id": i, "body": {"prompt": f"p{i}", **LONG}})
            started: set[str] = set()
            while len(started) < 8:
                started.add((await ws.receive_json(timeout=20))["id"])
        after = await until_idle(session, server)
    assert after["asyncllm:num_requests_running"] == 0
    assert after["asyncllm:kv_cache_usage_perc"] == idle["asyncllm:kv_cache_usage_perc"]


# -- metrics -------------------------------------------------------------------------------


async def test_metrics_use_vllm_names(server) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{server.url}/v1/completions", json={"prompt": "m", "max_tokens": 3}
        ):
            pass
        values = await metrics(session, server)
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
    ):
        assert f"asyncllm:{name}" in values, name
    assert values["asyncllm:generation_tokens_total"] >= 3
    assert values["process_cpu_seconds_total"] > 0  # the server process's own, as vLLM's
    assert "python_gc_collections_total" in values and "python_info" in values
    assert values["asyncllm:time_to_first_token_seconds_count"] >= 1


def sample_value(text: str, name: str, **labels: str) -> float:
    """The value of one labelled sample in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_metrics_vllm_dashboards_read(server) -> None:
    names = [
        "request_prompt_tokens_count", "request_generation_tokens_sum",
        "request_max_num_generation_tokens_sum", "request_params_n_sum",
        "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
        "request_inference_time_seconds_count",
    ]  # fmt: skip
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/metrics") as r:
            before = await r.text()
        for n, max_tokens in ((1, 3), (2, 2)):
            body = {"prompt": "m", "max_tokens": max_tokens, "ignore_eos": True, "n": n}
            async with session.post(f"{server.url}/v1/completions", json=body) as r:
                assert r.status == 200
        dropped = {"prompt": "d", "stream": True, **LONG}
        async with session.post(f"{server.url}/v1/completions", json=dropped) as r:
            await r.content.readuntil(b"data: ")
        await until_idle(session, server)
        async with session.get(f"{server.url}/metrics") as r:
            after = await r.text()

    def grew(name: str, **labels: str) -> float:
        full = f"asyncllm:{name}"
        return sample_value(after, full, **labels) - sample_value(before, full, **labels)

    assert grew("request_success_total", finished_reason="length") == 3
    assert grew("request_success_total", finished_reason="abort") == 1
    # the phases are timed where the engine reports them: not yet for parallel samples
    assert [grew(n) for n in names] == [2, 3 + 4, 3 + 2, 1 + 2, 1, 1, 1]
    assert grew("time_per_output_token_seconds_count") >= 2
    assert sample_value(after, "asyncllm:cache_config_info", block_size="16") == 1


async def test_iteration_tokens_count_the_tokens_of_each_engine_step(server) -> None:
    async with aiohttp.ClientSession() as session:
        await until_idle(session, server)
        async with session.get(f"{server.url}/metrics") as r:
            before = await r.text()
        for first in (3000, 3100):  # fresh prompts: no prefix cache hits
            body = {"prompt": list(range(first, first + 20)), "max_tokens": 4, "ignore_eos": True}
            async with session.post(f"{server.url}/v1/completions", json=body) as r:
                assert r.status == 200
        async with session.get(f"{server.url}/metrics") as r:
            after = await r.text()

    def grew(sample: str, **labels: str) -> float:
        name = f"asyncllm:iteration_tokens_total_{sample}"
        return sample_value(after, name, **labels) - sample_value(before, name, **labels)

    # each request: a step over its 20 prompt tokens, then one step per further token
    assert grew("count", model_name="tiny") == 2 * 4
    assert grew("sum") == 2 * (20 + 3)
    assert [grew("bucket", le=le) for le in ("1.0", "16.0", "32.0", "+Inf")] == [6, 6, 8, 8]


# -- the real default model ----------------------------------------------------------------


@pytest.mark.slow
def test_default_model_answers_a_chat(tmp_path) -> None:
    process = ServerProcess(tmp_path / "server.log", "--max-model-len", "1024")
    process.start()
    try:
        client = openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
    finally:
        assert process.stop() == 0
    assert "Paris" in reply.choices[0].message.content
