"""The Responses API of a real server, driven by the openai SDK, with its SQLite store in a
temporary folder: create, stream, background, resume, chains, cancel, delete, restart."""

from __future__ import annotations

import subprocess
import sys
import time

import openai
import pytest
from test_server_support import ServerProcess, tiny_server_args

from asyncllm.server.response_store import ResponseStoreError, open_response_store

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}
UNWRITABLE = "sqlite:////proc/asyncllm/responses.sqlite3"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("responses")
    store = f"sqlite:///{folder / 'responses.sqlite3'}"
    extra = ("--served-model-name", "tiny", "--response-store", store)
    args = tiny_server_args(tiny_model_dir, *extra)
    process = ServerProcess(folder / "server.log", *args)
    yield process.start()
    process.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def until_done(client: openai.OpenAI, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_create_answers_and_stores_the_response(client) -> None:
    response = client.responses.create(input="Say hello.", instructions="Be brief.", **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.output_text
    assert 0 < response.usage.output_tokens <= GREEDY["max_output_tokens"]
    stored = client.responses.retrieve(response.id)
    assert stored.output_text == response.output_text and stored.instructions == "Be brief."


def test_stream_sends_openai_events_in_sequence(client) -> None:
    whole = client.responses.create(input="Count.", **GREEDY)
    events = list(client.responses.create(input="Count.", stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert types[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_the_sdk_stream_helper_assembles_the_response(client) -> None:
    # get_final_response() wants response.completed, which a reply cut at max_output_tokens
    # (the tiny model rarely ends alone) does not send: OpenAI sends response.incomplete
    with client.responses.stream(input="Count.", **GREEDY) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas and done.text == deltas
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == deltas


def test_background_response_is_polled_to_the_same_text(client) -> None:
    expected = client.responses.create(input="A story.", **GREEDY).output_text
    started = client.responses.create(input="A story.", background=True, **GREEDY)
    assert started.status == "queued" and started.background
    assert until_done(client, started.id).output_text == expected


def test_a_background_stream_resumes_after_a_sequence_number(client) -> None:
    expected = client.responses.create(input="A poem.", **GREEDY).output_text
    stream = client.responses.create(input="A poem.", background=True, stream=True, **GREEDY)
    head = [next(iter(stream)) for _ in range(6)]
    stream.close()
    response_id = head[0].response.id
    tail = list(client.responses.retrieve(response_id, stream=True, starting_after=5))
    events = head + tail
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected


def test_previous_response_id_continues_the_conversation(client) -> None:
    first = client.responses.create(input="My name is Ann.", **GREEDY)
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, **GREEDY
    )
    alone = client.responses.create(input="What is my name?", **GREEDY)
    assert second.previous_response_id == first.id
    # the first exchange sits before the question: its input's message and its output
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError, match="does not exist or was deleted"):
        client.responses.create(input="x", previous_response_id="resp_unknown", **GREEDY)


def test_cancel_stops_a_background_response(client) -> None:
    long = {**GREEDY, "max_output_tokens": 400}
    started = client.responses.create(input="Go on.", background=True, **long)
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"
    foreground = client.responses.create(input="x", **GREEDY)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(foreground.id)


def test_delete_forgets_the_response(client) -> None:
    response = client.responses.create(input="x", **GREEDY)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_bad_inputs_are_refused_clearly(client) -> None:
    with pytest.raises(openai.BadRequestError, match="input is required"):
        client.responses.create(**GREEDY, extra_body={"input": None})
    with pytest.raises(openai.BadRequestError, match="only text input"):
        client.responses.create(input=[{"type": "input_image", "image_url": "x"}], **GREEDY)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.responses.create(input="x", model="tiny", temperature=-1)


def test_a_restart_keeps_stored_responses(server, client) -> None:
    response = client.responses.create(input="Remember me.", **GREEDY)
    server.stop()
    server.url = ""
    server.start()
    restarted = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kept = restarted.responses.retrieve(response.id)
    assert kept.output_text == response.output_text and kept.status == response.status


def test_an_unwritable_store_is_refused_before_the_model_loads() -> None:
    with pytest.raises(ResponseStoreError, match="cannot open the response store"):
        open_response_store(UNWRITABLE)
    command = [sys.executable, "-m", "asyncllm.serve", "--response-store", UNWRITABLE]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "cannot open the response store" in result.stderr
