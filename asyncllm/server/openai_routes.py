"""The OpenAI endpoints: completions, chat completions, models, tokenize, detokenize."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from inspect import signature
from typing import Any

from aiohttp import hdrs, web
from transformers import PreTrainedTokenizerBase

from asyncllm.engine.input_processor import PromptType
from asyncllm.outputs import RequestOutput
from asyncllm.server.protocol import (
    GenerationRequest,
    ProtocolError,
    TemplateOptions,
    decode_json_body,
    from_validation_error,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
    timed_out,
)
from asyncllm.server.reasoning_parsers import constrain_the_answer
from asyncllm.server.request_keys import RESPONSE_ID
from asyncllm.server.responses import ChunkBuilder
from asyncllm.server.resumable import resume_point
from asyncllm.server.state import STATE, Admission, ServerState
from asyncllm.server.streaming import (
    ChunkStream,
    NumberedEvents,
    chunk_events,
    json_response,
    merge_streams,
    numbered,
    serve_websocket,
    write_sse,
)
from asyncllm.server.tools import apply_tools, template_messages

_PARSERS = {"completions": parse_completion, "chat": parse_chat}
# WebSocket frames may name the endpoint by its path too
_ENDPOINTS = {
    "chat": "chat",
    "chat.completions": "chat",
    "/v1/chat/completions": "chat",
    "completions": "completions",
    "/v1/completions": "completions",
}
MAX_CHOICES = 128  # prompts x samples in one request: each is an engine request


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; one declared as anything but JSON is refused (415)."""
    declared = hdrs.CONTENT_TYPE in request.headers
    if declared and not _is_json(request.content_type):
        raise ProtocolError(
            f"the body must be JSON (Content-Type: application/json), not {request.content_type}.",
            status=415,
            code="unsupported_media_type",
        )
    try:
        async with asyncio.timeout(request.app[STATE].args.body_timeout or None):
            raw = await request.read()
    except TimeoutError as e:
        raise timed_out("the request's body took too long to arrive.") from e
    except web.HTTPRequestEntityTooLarge as e:
        raise ProtocolError(
            e.text or "the request body is too large.",
            status=413,
            code="request_too_large",
        ) from e
    return decode_json_body(raw)


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


class OpenAIRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- generation --------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        return await serve_websocket(request, self, self.state.args.max_request_body_bytes)

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        req = self.parse_request(endpoint, await read_json(request))
        response_id = _response_id(req)
        request[RESPONSE_ID] = response_id
        if req.stream:
            return await write_sse(request, self._stream(req, response_id))
        with self.state.admit(req.timeout) as admission:
            return json_response(await self._complete(req, response_id, admission))

    def open_stream(self, endpoint: str, body: dict[str, Any]) -> tuple[str, NumberedEvents]:
        """One WebSocket request (admission errors surface on the first read)."""
        if not isinstance(endpoint, str) or endpoint not in _ENDPOINTS:
            raise ProtocolError(
                "endpoint must be 'chat' or 'completions'.", status=404, param="endpoint"
            )
        req = self.parse_request(_ENDPOINTS[endpoint], body)
        response_id = _response_id(req)
        return response_id, self._stream(req, response_id)

    def _stream(self, req: GenerationRequest, response_id: str) -> NumberedEvents:
        """The request's events; a resumable one's generation runs on its own, in the registry."""
        events = chunk_events(self.admitted_chunks(req, response_id))
        if not req.resumable:
            return numbered(events)
        stream = self.state.streams.start(response_id, events)
        return stream.replay(-1, self.state.args.keepalive_interval)

    async def admitted_chunks(self, req: GenerationRequest, response_id: str) -> ChunkStream:
        with self.state.admit(req.timeout) as admission:
            async with aclosing(self._chunks(req, response_id, admission)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/streams/{id}: the events after Last-Event-ID (or ?starting_after), then the
        live stream."""
        stream_id = request.match_info["stream_id"]
        request[RESPONSE_ID] = stream_id
        return await write_sse(request, self.resume_stream(stream_id, resume_point(request)))

    def resume_stream(self, stream_id: str, after: int) -> NumberedEvents:
        stream = self.state.streams.get(stream_id)
        stream.check_after(after)
        return stream.replay(after, self.state.args.keepalive_interval)

    def cancel_stream(self, stream_id: str) -> None:
        self.state.streams.cancel(stream_id)

    def parse_request(self, endpoint: str, body: dict[str, Any]) -> GenerationRequest:
        defaults = self.engine.config.model.sampling_defaults
        req = _PARSERS[endpoint](body, self.engine.input_processor.vocab_size, defaults)
        if req.model is not None and req.model not in self.state.model_names:
            raise ProtocolError(
                f"The model `{req.model}` does not exist.",
                status=404,
                param="model",
                code="model_not_found",
            )
        if req.num_choices > MAX_CHOICES:
            raise ProtocolError(
                f"a request may ask for at most {MAX_CHOICES} choices (prompts times n or "
                f"best_of); this one asks for {req.num_choices}.",
                param="n",
            )
        self._check_prompt_chars(req)
        self._check_chat_template_kwargs(req.chat_template_kwargs)
        if req.kind == "chat":
            self._shape_reply(req)
        return req

    def _shape_reply(self, req: GenerationRequest) -> None:
        """Tools for the template, tool_choice's constraint, and how the reply is read."""
        args = self.state.args
        try:
            req.message_shape, tools = apply_tools(
                req.tool_fields, req.params, args.tool_call_parser, args.reasoning_parser
            )
        except ValueError as e:
            raise from_validation_error(e) from e
        if args.reasoning_parser is not None:
            constrain_the_answer(req.params, args.reasoning_parser, self.tokenizer)
        if tools is not None:
            req.chat_template_kwargs = {**req.chat_template_kwargs, "tools": tools}
        req.messages = template_messages(req.messages or [])

    def _check_prompt_chars(self, req: GenerationRequest) -> None:
        limit = self.state.max_prompt_chars
        if req.kind == "chat":
            texts = [sum(len(m["content"]) for m in req.messages or [])]
        else:
            texts = [len(p) for p in req.prompts if isinstance(p, str)]
        if limit is not None and max(texts, default=0) > limit:
            raise ProtocolError(
                f"the prompt is {max(texts)} characters long; at most {limit} can fit in the "
                f"maximum model length ({self.engine.config.model.max_model_len}).",
                param="messages" if req.kind == "chat" else "prompt",
                code="context_length_exceeded",
            )

    def _check_chat_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Template variables only: no template from the request unless trusted (templates are
        sandboxed, yet one can loop for ever), no tokenizer options."""
        refused = sorted(kwargs.keys() & _TEMPLATE_CALL_OPTIONS)
        if self.state.args.trust_request_chat_template:
            refused = [k for k in refused if k != "chat_template"]
        if refused:
            raise ProtocolError(
                f"chat_template_kwargs may not set {', '.join(refused)}.",
                param="chat_template_kwargs",
            )

    async def _outputs(
        self, req: GenerationRequest, response_id: str, admission: Admission
    ) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """(prompt index, output) of every prompt's engine request; None on keep-alive ticks."""
        if req.kind == "completion":
            prompts = req.prompts
        else:
            prompts = [self._render_chat(req.messages, req.template, req.chat_template_kwargs)]
        ids = [
            f"{response_id}-{i}" if len(prompts) > 1 else response_id for i in range(len(prompts))
        ]
        streams = [self._engine_stream(p, req, i) for p, i in zip(prompts, ids)]
        admission.engine_ids = ids
        keepalive = self.state.args.keepalive_interval
        merged = merge_streams(streams, keepalive, admission.cutoff)
        async with aclosing(merged):
            async for item in merged:
                yield item

    async def _engine_stream(
        self, prompt: PromptType, req: GenerationRequest, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        prompt = await self._with_token_ids(prompt, req)
        tracker = self.state.metrics.tracker(req.params)
        try:
            outputs = self.engine.generate(
                prompt, req.params, request_id, req.priority, req.add_special_tokens
            )
            async with aclosing(outputs):
                async for output in outputs:
                    tracker.observe(output)
                    if output.error is not None:
                        raise ProtocolError(output.error, status=500, type="internal_server_error")
                    yield output
        except ValueError as e:  # the input processor's validation
            raise from_validation_error(e) from e
        except BaseException:  # dropped, cut off or failed
            tracker.abort()
            raise

    async def _with_token_ids(self, prompt: PromptType, req: GenerationRequest) -> PromptType:
        """Tokenized here, not in the engine, to check an explicit max_tokens against the room the
        prompt leaves."""
        text = self.engine.input_processor.prompt_text(prompt)
        if text is not None:
            token_ids = await self.engine.prompt_tokenizer.encode(text, req.add_special_tokens)
            prompt = {"prompt": text, "prompt_token_ids": token_ids}
        self._check_room(len(prompt["prompt_token_ids"]), req)
        return prompt

    def _check_room(self, prompt_tokens: int, req: GenerationRequest) -> None:
        """The prompt must leave room for a token, and a max_tokens the request sets must fit
        beside it; an omitted one is clamped to the room left."""
        limit = self.engine.config.model.max_model_len
        if prompt_tokens >= limit:
            raise ProtocolError(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_tokens}, which leaves no room for a completion: shorten it.",
                param="messages" if req.kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        if req.max_tokens_field is None:
            return
        wanted = 0 if req.echo_only else req.params.max_tokens
        if prompt_tokens + wanted > limit:
            raise ProtocolError(
                f"this model's maximum context length is {limit} tokens; the request asks for "
                f"{prompt_tokens + wanted} ({prompt_tokens} in the prompt, {wanted} for the "
                f"completion): shorten the prompt or lower {req.max_tokens_field}.",
                param=req.max_tokens_field,
                code="context_length_exceeded",
            )

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        template: TemplateOptions,
        template_kwargs: dict[str, Any],
    ) -> str:
        try:
            return self.engine.input_processor.apply_chat_template(
                messages,
                add_generation_prompt=template.add_generation_prompt,
                continue_final_message=template.continue_final_message,
                **template_kwargs,
            )
        except (ValueError, TypeError) as e:
            raise ProtocolError(str(e), param="messages") from e

    async def _chunks(
        self, req: GenerationRequest, response_id: str, admission: Admission
    ) -> ChunkStream:
        builder = ChunkBuilder(req, response_id, self.state.model_name, self.tokenizer)
        async with aclosing(self._outputs(req, response_id, admission)) as outputs:
            async for item in outputs:
                if item is None:
                    yield None
                    continue
                for chunk in builder.chunks(*item):
                    yield chunk
        if req.include_usage:
            yield builder.usage_chunk()

    async def _complete(
        self, req: GenerationRequest, response_id: str, admission: Admission
    ) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(self._outputs(req, response_id, admission)) as outputs:
            async for item in outputs:
                if item is not None:
                    finals[item[0]] = item[1]
        builder = ChunkBuilder(req, response_id, self.state.model_name, self.tokenizer)
        return builder.response([finals[i] for i in sorted(finals)])

    # -- the rest of the API -----------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the SDK's models.retrieve."""
        if request.match_info["model"] not in self.state.model_names:
            raise ProtocolError(
                f"The model `{request.match_info['model']}` does not exist.",
                status=404,
                param="model",
                code="model_not_found",
            )
        return json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.state.model_name,
            "object": "model",
            "created": self.state.started,
            "owned_by": "asyncllm",
            "root": self.state.model_root,
            "parent": None,
            "max_model_len": self.engine.config.model.max_model_len,
        }

    async def tokenize(self, request: web.Request) -> web.Response:
        req = parse_tokenize(await read_json(request))
        tokenizer = self._require_tokenizer()
        prompt = req.prompt
        if req.messages is not None:
            prompt = self._render_chat(req.messages, req.template, {})
        tokens = await self.engine.prompt_tokenizer.encode(prompt, req.add_special_tokens)
        answer = {
            "count": len(tokens),
            "max_model_len": self.engine.config.model.max_model_len,
            "tokens": tokens,
        }
        if req.return_token_strs:
            answer["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
        return json_response(answer)

    async def detokenize(self, request: web.Request) -> web.Response:
        tokens = parse_detokenize(await read_json(request))
        tokenizer = self._require_tokenizer()
        vocab_size = self.engine.input_processor.vocab_size
        if any(not 0 <= t < vocab_size for t in tokens):
            raise ProtocolError(f"tokens must be in [0, {vocab_size}).", param="tokens")
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(None, tokenizer.decode, tokens)
        return json_response({"prompt": text})

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer.")
        return self.tokenizer


# apply_chat_template's own parameters, which a request must not reach through the kwargs
_TEMPLATE_CALL_OPTIONS = {
    name
    for name in signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    if name not in ("self", "tools", "documents", "kwargs")
}


def _response_id(req: GenerationRequest) -> str:
    prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"
