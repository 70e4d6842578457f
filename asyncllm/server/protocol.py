"""OpenAI request bodies -> (prompts, SamplingParams), and the OpenAI error shape.

Plain functions over the decoded JSON: every field is checked for its type against the table
in server/fields.py, every sampling value's range by SamplingParams itself, so a request that
fails either never reaches the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from asyncllm.engine.input_processor import PromptType
from asyncllm.errors import ValidationError
from asyncllm.sampling_params import RequestOutputKind, SamplingParams
from asyncllm.server.chat_message import MessageShape
from asyncllm.server.fields import (
    CHAT,
    COMPLETIONS,
    DETOKENIZE,
    MESSAGE_FIELDS,
    TOKENIZE,
    Field,
    fields_for,
    is_json_type,
)
from asyncllm.server.structured_outputs import check_constraint, from_response_format


class ProtocolError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": {**error, "code": self.code}}


def from_validation_error(error: ValueError) -> ProtocolError:
    """The engine's refusal (prompt length, token ids, sampling ranges) -> a 400; a
    ValidationError names its field and code."""
    if isinstance(error, ValidationError):
        return ProtocolError(str(error), param=error.param, code=error.code)
    return ProtocolError(str(error))


def overloaded(message: str, status: int = 503, retry_after_s: int = 1) -> ProtocolError:
    """A refusal worth retrying (429 or 503): it says when, in Retry-After."""
    kind = "rate_limit_exceeded" if status == 429 else "service_unavailable"
    code = "too_many_requests" if status == 429 else "service_unavailable"
    headers = {"Retry-After": str(retry_after_s)}
    return ProtocolError(message, status=status, type=kind, code=code, headers=headers)


def timed_out(message: str) -> ProtocolError:
    return ProtocolError(message, status=408, type="timeout_error", code="request_timeout")


def decode_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object.")
    return body


@dataclass(frozen=True)
class TemplateOptions:
    """How the chat template ends the conversation: with the opening of a new assistant message,
    or inside the last message, which the reply continues (vLLM's two fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass
class GenerationRequest:
    """A parsed /v1/completions or /v1/chat/completions body."""

    kind: str  # "completion" | "chat"
    model: str | None
    params: SamplingParams
    prompts: list[PromptType] = field(default_factory=list)  # completions
    messages: list[dict[str, Any]] | None = None  # chat, before the chat template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    template: TemplateOptions = field(default_factory=TemplateOptions)
    stream: bool = False
    include_usage: bool = False
    resumable: bool = False  # generation outlives the connection; GET /v1/streams/{id} resumes
    continuous_usage: bool = False  # the usage so far in every chunk
    echo: bool = False
    priority: int = 0
    logprobs: int | None = None  # top-N alternatives per token; None: no logprobs
    prompt_logprobs: int | None = None  # as asked; echo with logprobs asks the engine too
    echo_only: bool = False  # echo with max_tokens 0: the prompt scored, nothing generated
    max_tokens_field: str | None = None  # the field that set max_tokens; None: left out
    timeout: float | None = None  # seconds the whole request may take, queue included
    # chat: tools, tool_choice and parallel_tool_calls as given, and the reply's shape
    tool_fields: dict[str, Any] = field(default_factory=dict)
    message_shape: MessageShape = field(default_factory=MessageShape)

    @property
    def num_choices(self) -> int:
        return max(len(self.prompts), 1) * self.params.num_samples

    @property
    def add_special_tokens(self) -> bool:
        return self.kind == "completion"  # the chat template already holds them


def parse_completion(
    body: dict[str, Any], vocab_size: int | None = None, defaults: dict[str, Any] | None = None
) -> GenerationRequest:
    """defaults: SamplingParams values for the fields the body leaves out (the model's)."""
    values = _whole_vocabulary(checked_fields(body, COMPLETIONS), vocab_size)
    echo = values.get("echo", False)
    echo_only = echo and values.get("max_tokens") == 0
    overrides = _echo_overrides(values, echo_only)
    params = _sampling_params(values, COMPLETIONS, defaults or {}, **overrides)
    return GenerationRequest(
        kind="completion",
        prompts=_parse_prompt(values["prompt"]),
        echo=echo,
        echo_only=echo_only,
        logprobs=params.logprobs,
        **_common(values, params),
    )


def _echo_overrides(values: dict[str, Any], echo_only: bool) -> dict[str, Any]:
    """Echo with logprobs covers the prompt's tokens too: the engine scores them. max_tokens 0
    with echo (vLLM's way to score a prompt) runs one token, which the answer leaves out."""
    overrides: dict[str, Any] = {"max_tokens": 1} if echo_only else {}
    logprobs = values.get("logprobs")
    if values.get("echo") and logprobs is not None:
        overrides["prompt_logprobs"] = max(values.get("prompt_logprobs") or 0, logprobs)
    return overrides


def parse_chat(
    body: dict[str, Any], vocab_size: int | None = None, defaults: dict[str, Any] | None = None
) -> GenerationRequest:
    values = _whole_vocabulary(checked_fields(body, CHAT), vocab_size)
    params = _sampling_params(values, CHAT, defaults or {}, logprobs=_chat_logprobs(values))
    messages = _parse_messages(values["messages"])
    return GenerationRequest(
        kind="chat",
        messages=messages,
        chat_template_kwargs=values.get("chat_template_kwargs", {}),
        template=_template_options(values, messages),
        echo=values.get("echo", False),
        tool_fields={k: values[k] for k in _TOOL_FIELDS if k in values},
        logprobs=params.logprobs,
        **_common(values, params),
    )


_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def _whole_vocabulary(values: dict[str, Any], vocab_size: int | None) -> dict[str, Any]:
    """vLLM's logprobs (top_logprobs) -1: every token of the vocabulary, which the engine then
    bounds by its max_logprobs."""
    for name in ("logprobs", "top_logprobs"):
        if values.get(name) == -1 and vocab_size is not None:
            values = {**values, name: vocab_size}
    return values


def _common(values: dict[str, Any], params: SamplingParams) -> dict[str, Any]:
    """The GenerationRequest fields both routes share."""
    stream = values.get("stream", False)
    if "stream_options" in values and not stream:
        raise ProtocolError(
            "stream_options is only allowed with stream: true.", param="stream_options"
        )
    options = values.get("stream_options", {})
    include_usage = options.get("include_usage", False)
    return {
        "model": values.get("model"),
        "params": params,
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": include_usage and options.get("continuous_usage_stats", False),
        "resumable": options.get("resumable", False),
        "priority": values.get("priority", 0),
        "prompt_logprobs": values.get("prompt_logprobs"),
        "max_tokens_field": next(
            (name for name in ("max_completion_tokens", "max_tokens") if name in values), None
        ),
        "timeout": values.get("timeout"),
    }


def checked_fields(body: dict[str, Any], route: str) -> dict[str, Any]:
    return checked_values(body, fields_for(route))


def checked_values(body: dict[str, Any], fields: Iterable[Field], at: str = "") -> dict[str, Any]:
    """The fields the body holds (null counts as absent), each of its JSON type (else 400, code
    invalid_type) and, for the server's own fields, in range (else 400); `at` is where the body
    sits in the request. Unknown fields are ignored."""
    values = {}
    for f in fields:
        value, path = body.get(f.name), at + f.name
        if value is not None:
            values[f.name] = _checked(f, value, path)
        elif f.required:
            raise ProtocolError(
                f"{path} is required.", param=path, code="missing_required_parameter"
            )
    return values


def _checked(f: Field, value: Any, path: str) -> Any:
    if "integer" in f.types and _outside_int64(value):
        raise ProtocolError(f"{path} must be an integer in [-2^63, 2^63 - 1].", param=path)
    if not f.accepts(value):
        message = f"{path} must be {f.type_text()}."
        raise ProtocolError(message, param=path, code="invalid_type")
    if f.members:
        value = {**value, **checked_values(value, f.members, f"{path}.")}
    if f.param is None and f.has_range and not f.in_range(value):
        raise ProtocolError(f"{path} must be {f.range_text()}.", param=path)
    return float(value) if f.types == ("number",) else value


def _outside_int64(value: Any) -> bool:
    """orjson reads an integer beyond 64 bits as a float: an integral one that large was one."""
    if isinstance(value, float):
        return value.is_integer() and abs(value) >= 2**63
    return is_json_type(value, "integer") and not -(2**63) <= value < 2**63


def _parse_prompt(prompt: str | list[Any]) -> list[PromptType]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if all(is_json_type(t, "integer") for t in prompt) and prompt:
        return [{"prompt_token_ids": prompt}]
    if all(isinstance(p, str) for p in prompt) and prompt:
        return list(prompt)
    if prompt and all(_is_token_ids(p) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    raise ProtocolError(
        "prompt must be a string, an array of strings, an array of token ids "
        "or an array of token-id arrays.",
        param="prompt",
    )


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(is_json_type(t, "integer") for t in value)
    )


def _parse_messages(messages: list[Any]) -> list[dict[str, Any]]:
    if not messages:
        raise ProtocolError(
            "messages must be a non-empty array of message objects.", param="messages"
        )
    return [_parse_message(m, i) for i, m in enumerate(messages)]


def _parse_message(message: Any, index: int) -> dict[str, Any]:
    at = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ProtocolError(f"{at} must be an object.", param=at)
    values = checked_values(message, MESSAGE_FIELDS, f"{at}.")
    if not values["role"]:
        raise ProtocolError(f"{at}.role must not be empty.", param=f"{at}.role")
    if "content" not in values and values["role"] != "assistant":
        message_text = f"{at}.content is required: only an assistant message may leave it out."
        raise ProtocolError(message_text, param=f"{at}.content")
    return {**message, "content": _message_text(values.get("content"), at)}


def _message_text(content: str | list[Any] | None, param: str) -> str:
    """String content as is; an array of content parts joined (text parts only)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ProtocolError(
                f"{param}.content: only text content parts are supported.",
                param=f"{param}.content",
            )
        if not isinstance(part.get("text"), str):
            raise ProtocolError(
                f"{param}.content: a text part needs a string text.",
                param=f"{param}.content",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _template_options(values: dict[str, Any], messages: list[dict[str, Any]]) -> TemplateOptions:
    """Continuing the last message excludes opening a new one (which is the default), and
    needs that message to be the assistant's."""
    options = TemplateOptions(
        add_generation_prompt=values.get("add_generation_prompt", True),
        continue_final_message=values.get("continue_final_message", False),
    )
    if options.continue_final_message and options.add_generation_prompt:
        raise ProtocolError(
            "continue_final_message and add_generation_prompt cannot both be true "
            "(add_generation_prompt defaults to true: set it to false).",
            param="continue_final_message",
        )
    if options.continue_final_message and messages[-1]["role"] != "assistant":
        raise ProtocolError(
            "continue_final_message needs the last message to be the assistant's.",
            param="continue_final_message",
        )
    return options


def _chat_logprobs(values: dict[str, Any]) -> int | None:
    """Chat asks with logprobs: bool and top_logprobs: int; the engine with one int."""
    wanted = values.get("logprobs", False)
    top = values.get("top_logprobs")
    if top is not None and not wanted:
        raise ProtocolError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    return (top or 0) if wanted else None


def _sampling_params(
    values: dict[str, Any], route: str, defaults: dict[str, Any], **overrides: Any
) -> SamplingParams:
    """The table's sampling fields by their SamplingParams names (a later field wins, as
    max_completion_tokens over max_tokens), the defaults for those left out; out-of-range values
    become a 400."""
    kwargs: dict[str, Any] = {"max_tokens": None}  # the rest of the context, unless the route says
    for f in fields_for(route):
        value = values.get(f.name, f.default)
        if f.param is not None and value is not None:
            kwargs[f.param] = value
    kwargs.update(_defaults_left_out(kwargs, values, route, defaults))
    stream = values.get("stream", False)
    kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    response_format = values.get("response_format")
    try:
        if response_format is not None:
            kwargs["structured_outputs"] = from_response_format(
                response_format, kwargs.get("structured_outputs")
            )
        params = SamplingParams(**{**kwargs, **overrides})
        check_constraint(params, (response_format or {}).get("type") not in (None, "text"))
        return params
    except ValueError as e:
        raise from_validation_error(e) from e


def _defaults_left_out(
    kwargs: dict[str, Any], values: dict[str, Any], route: str, defaults: dict[str, Any]
) -> dict[str, Any]:
    """The defaults of the parameters no field of the body set; an omitted max_tokens takes the
    smaller of the route's default (16 for completions) and the model's, as vLLM does."""
    given = {f.param for f in fields_for(route) if f.name in values}
    chosen = {name: value for name, value in defaults.items() if name not in given}
    if chosen.get("max_tokens") is not None and kwargs.get("max_tokens") is not None:
        chosen["max_tokens"] = min(chosen["max_tokens"], kwargs["max_tokens"])
    return chosen


@dataclass
class TokenizeRequest:
    """A parsed /tokenize body: exactly one of prompt and messages (with its template
    options)."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    return_token_strs: bool
    template: TemplateOptions = field(default_factory=TemplateOptions)


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    values = checked_fields(body, TOKENIZE)
    prompt, messages = values.get("prompt"), values.get("messages")
    if (prompt is None) == (messages is None):
        raise ProtocolError("give either prompt or messages.", param="prompt")
    template = TemplateOptions()
    if messages is not None:
        messages = _parse_messages(messages)
        template = _template_options(values, messages)
    return TokenizeRequest(
        prompt=prompt,
        messages=messages,
        add_special_tokens=values.get("add_special_tokens", messages is None),
        return_token_strs=values.get("return_token_strs", False),
        template=template,
    )


def parse_detokenize(body: dict[str, Any]) -> list[int]:
    return checked_fields(body, DETOKENIZE)["tokens"]
