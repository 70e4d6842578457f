"""OpenAI's Responses API over the chat route: POST /v1/responses, GET/DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel.

A response is a chat completion of its conversation (the previous response's, then its input)
whose chunks become the Responses stream events, numbered by sequence_number. Stored responses
live in a ResponseStore; background ones run as resumable streams, so GET with stream=true and
starting_after=N picks a stream up after event N.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from asyncllm.server.fields import RESPONSES
from asyncllm.server.openai_routes import OpenAIRoutes, read_json
from asyncllm.server.protocol import ProtocolError, checked_fields
from asyncllm.server.request_keys import RESPONSE_ID
from asyncllm.server.response_store import ResponseStore, StoredResponse
from asyncllm.server.resumable import resume_point
from asyncllm.server.streaming import (
    ChunkStream,
    Event,
    EventStream,
    error_for,
    json_response,
    numbered,
    write_sse,
)

_SAMPLING = ("temperature", "top_p")  # passed to the chat route as they are
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesRequest:
    body: dict[str, Any]  # the checked fields
    messages: list[dict[str, Any]]  # the input as chat messages
    history: list[dict[str, Any]] = field(default_factory=list)  # previous_response_id's

    @property
    def background(self) -> bool:
        return self.body.get("background", False)

    @property
    def stream(self) -> bool:
        return self.body.get("stream", False)

    @property
    def store(self) -> bool:
        return self.body.get("store", True)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return self.history + self.messages

    def chat_body(self) -> dict[str, Any]:
        instructions = self.body.get("instructions")
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat = {"messages": system + self.conversation, "stream": True}
        chat["stream_options"] = {"include_usage": True}
        chat |= {name: self.body[name] for name in _SAMPLING if name in self.body}
        if "model" in self.body:
            chat["model"] = self.body["model"]
        if "max_output_tokens" in self.body:
            chat["max_tokens"] = self.body["max_output_tokens"]
        return chat


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """`input`: a string (one user message) or message items, whose content is a string or
    text parts."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return [_message(item, f"input[{i}]") for i, item in enumerate(value)]


def _message(item: Any, at: str) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise ProtocolError(f"{at} must be a message item (only text input is served).", param=at)
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant", "system", "developer"):
        raise ProtocolError(f"{at}.role must be user, assistant, system or developer.", param=at)
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in content):
            raise ProtocolError(f"{at}.content may hold only text parts.", param=f"{at}.content")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise ProtocolError(f"{at}.content must be a string or text parts.", param=at)
    return {"role": "system" if role == "developer" else role, "content": content}


class ResponseBuilder:
    """One response: its object as it stands, and the stream events that get it there."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.id = response_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.status = "queued" if req.background else "in_progress"
        self.text: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.sequence_number = 0
        self.item_added = False  # the output message exists once response.output_item.added

    def response(self) -> dict[str, Any]:
        body = self.req.body
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "background": self.req.background,
            "model": self.model,
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "metadata": body.get("metadata", {}),
            "output": [self._message_item()] if self.item_added else [],
            "output_text": "".join(self.text),
            "usage": self.usage,
            "error": self.error,
            "incomplete_details": incomplete,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "store": self.req.store,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
        }

    def _message_item(self) -> dict[str, Any]:
        done = self.status in ("completed", "incomplete")
        return {
            "type": "message",
            "id": self.message_id,
            "status": "completed" if done else self.status_of_item(),
            "role": "assistant",
            "content": [self._text_part()],
        }

    def status_of_item(self) -> str:
        return "in_progress" if self.status in ("queued", "in_progress") else "incomplete"

    def _text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": "".join(self.text), "annotations": []}

    def stored(self) -> StoredResponse:
        reply = {"role": "assistant", "content": "".join(self.text)}
        return StoredResponse(self.response(), [*self.req.conversation, reply])

    def event(self, name: str, **payload: Any) -> Event:
        data = {"type": name, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return Event(orjson.dumps(data), name=name)

    def opening(self) -> list[Event]:
        self.status = "in_progress"
        where = {"output_index": 0, "item_id": self.message_id}
        item = {**self._message_item(), "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        events = [
            self.event("response.created", response=self.response()),
            self.event("response.in_progress", response=self.response()),
            self.event("response.output_item.added", output_index=0, item=item),
            self.event("response.content_part.added", **where, content_index=0, part=part),
        ]
        self.item_added = True
        return events

    def on_chunk(self, chunk: dict[str, Any]) -> list[Event]:
        if chunk.get("usage"):
            usage = chunk["usage"]
            self.usage = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]
                },  # fmt: skip
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        events = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {}).get("content")
            if delta:
                self.text.append(delta)
                where = {"output_index": 0, "item_id": self.message_id, "content_index": 0}
                events.append(
                    self.event("response.output_text.delta", **where, delta=delta, logprobs=[])
                )
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def closing(self) -> list[Event]:
        self.status = "incomplete" if self.finish_reason == "length" else "completed"
        where = {"output_index": 0, "item_id": self.message_id, "content_index": 0}
        text = "".join(self.text)
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=self._text_part()),
            self.event("response.output_item.done", output_index=0, item=self._message_item()),
            self.event(f"response.{self.status}", response=self.response()),
        ]

    def failure(self, error: ProtocolError) -> Event:
        self.status = "failed"
        self.error = {"code": error.type, "message": error.message}
        return self.event("response.failed", response=self.response())


class ResponsesRoutes:
    def __init__(self, routes: OpenAIRoutes, store: ResponseStore) -> None:
        self.routes = routes
        self.state = routes.state
        self.store = store

    async def create(self, request: web.Request) -> web.StreamResponse:
        req = await self._parse(await read_json(request))
        chat = self.routes.parse_request("chat", req.chat_body())
        response_id = f"resp_{uuid.uuid4().hex}"
        request[RESPONSE_ID] = response_id
        builder = ResponseBuilder(req, response_id, self.state.model_name)
        events = self._events(builder, self.routes.admitted_chunks(chat, response_id))
        if req.background:
            await self._save(builder)
            stream = self.state.streams.start(response_id, events)
            if req.stream:
                return await write_sse(request, stream.replay(-1, self._keepalive))
            return json_response(builder.response())
        if req.stream:
            return await write_sse(request, numbered(events))
        async with aclosing(events) as running:
            async for _ in running:
                pass
        if builder.status == "failed":
            raise ProtocolError(builder.error["message"], status=500, type="server_error")
        return json_response(builder.response())

    async def _parse(self, body: dict[str, Any]) -> ResponsesRequest:
        values = checked_fields(body, RESPONSES)
        if values.get("store") is False and values.get("background"):
            raise ProtocolError("a background response must be stored.", param="store")
        req = ResponsesRequest(values, input_messages(values["input"]))
        previous = values.get("previous_response_id")
        if previous is not None:
            req.history = (await self._stored(previous, "previous_response_id")).messages
        return req

    async def _stored(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = await self.store.get(response_id)
        if stored is None:
            raise ProtocolError(
                f"no response {response_id!r}: it does not exist or was deleted.",
                status=404,
                param=param,
                code="response_not_found",
            )
        return stored

    async def _events(self, builder: ResponseBuilder, chunks: ChunkStream) -> EventStream:
        """The response's events; a background one is stored as it starts, and every stored one
        once it ends (completed, incomplete, failed or cancelled)."""
        async with aclosing(chunks):
            first = await self._first(builder, chunks)  # a refusal is raised before any event
            for event in builder.opening():
                yield event
            if builder.req.background:
                await self._save(builder)
            try:
                for event in [] if first is None else builder.on_chunk(first):
                    yield event
                async for chunk in chunks:
                    if chunk is None:
                        yield None
                        continue
                    for event in builder.on_chunk(chunk):
                        yield event
                closing = builder.closing()
            except asyncio.CancelledError:
                builder.status = "cancelled"
                await self._save(builder)
                raise
            except Exception as e:
                closing = [builder.failure(error_for(e))]
            await self._save(builder)
        for event in closing:
            yield event

    async def _first(self, builder: ResponseBuilder, chunks: ChunkStream) -> dict[str, Any] | None:
        try:
            return await anext(chunks, None)
        except Exception as e:
            if builder.req.background:  # its creator already has its id: it fails stored
                builder.failure(error_for(e))
                await self._save(builder)
            raise

    async def _save(self, builder: ResponseBuilder) -> None:
        if builder.req.store:
            await self.store.put(builder.stored())

    @property
    def _keepalive(self) -> float:
        return self.state.args.keepalive_interval

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["response_id"]
        request[RESPONSE_ID] = response_id
        if request.query.get("stream", "false").lower() == "true":
            events = self.routes.resume_stream(response_id, resume_point(request))
            return await write_sse(request, events)
        return json_response((await self._stored(response_id)).response)

    async def cancel(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = await self._stored(response_id)
        if not stored.response.get("background"):
            raise ProtocolError("only a background response can be cancelled.")
        await self._stop(response_id)
        return json_response((await self._stored(response_id)).response)

    async def _stop(self, response_id: str) -> None:
        """Cancels a background response still running, and waits until it is stored so."""
        stream = self.state.streams.streams.get(response_id)
        if stream is None or stream.task is None or stream.task.done():
            return
        stream.cancel()
        await asyncio.gather(stream.task, return_exceptions=True)
        stored = await self.store.get(response_id)
        if stored is not None and stored.response["status"] in ("queued", "in_progress"):
            stored.response["status"] = "cancelled"  # it was cancelled before it started
            await self.store.put(stored)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        await self._stop(response_id)
        if not await self.store.delete(response_id):
            await self._stored(response_id)  # the 404
        return json_response({"id": response_id, "object": "response", "deleted": True})
