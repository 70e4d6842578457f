"""OpenAI request bodies -> (prompts, SamplingParams), and the OpenAI error shape.

Plain functions over the decoded JSON: every field is checked for its type here, every value
range by SamplingParams itself, so a request that fails either never reaches the engine.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from asyncllm.engine.input_processor import PromptType
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_MISSING = object()


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
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_value_error(error: ValueError) -> ProtocolError:
    """Engine-side validation (prompt length, token ids, sampling ranges) -> a 400."""
    message = str(error)
    if "maximum model length" in message:
        return ProtocolError(message, code="context_length_exceeded")
    param = message.split(" ", 1)[0].rstrip(":") if message else None
    return ProtocolError(message, param=param if param and param.isidentifier() else None)


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
        raise ProtocolError("the request body must be a JSON object.", status=422)
    return body


@dataclass
class GenerationRequest:
    """A parsed /v1/completions or /v1/chat/completions body."""

    kind: str  # "completion" | "chat"
    model: str | None
    params: SamplingParams
    prompts: list[PromptType] = field(default_factory=list)  # completions
    messages: list[dict[str, Any]] | None = None  # chat, before the chat template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    priority: int = 0
    logprobs: int | None = None  # top-N alternatives per token; None: no logprobs
    timeout: float | None = None  # seconds the whole request may take, queue included

    @property
    def num_choices(self) -> int:
        return max(len(self.prompts), 1) * self.params.num_samples

    @property
    def add_special_tokens(self) -> bool:
        return self.kind == "completion"  # the chat template already holds them


def parse_completion(body: dict[str, Any]) -> GenerationRequest:
    prompts = _parse_prompt(body.get("prompt", _MISSING))
    logprobs = _get(body, "logprobs", int)
    stream, include_usage = _parse_stream(body)
    params = _sampling_params(
        body,
        stream,
        max_tokens=_get(body, "max_tokens", int, 16),
        logprobs=logprobs,
    )
    return GenerationRequest(
        kind="completion",
        model=_get(body, "model", str),
        params=params,
        prompts=prompts,
        stream=stream,
        include_usage=include_usage,
        echo=_get(body, "echo", bool, False),
        priority=_get(body, "priority", int, 0),
        logprobs=logprobs,
        timeout=_parse_timeout(body),
    )


def parse_chat(body: dict[str, Any]) -> GenerationRequest:
    messages = _parse_messages(body.get("messages", _MISSING))
    logprobs = _chat_logprobs(body)
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    stream, include_usage = _parse_stream(body)
    return GenerationRequest(
        kind="chat",
        model=_get(body, "model", str),
        params=_sampling_params(body, stream, max_tokens=max_tokens, logprobs=logprobs),
        messages=messages,
        chat_template_kwargs=_get(body, "chat_template_kwargs", dict, {}),
        stream=stream,
        include_usage=include_usage,
        priority=_get(body, "priority", int, 0),
        logprobs=logprobs,
        timeout=_parse_timeout(body),
    )


def _parse_timeout(body: dict[str, Any]) -> float | None:
    timeout = _get(body, "timeout", float)
    if timeout is not None and not 0 < timeout < 10**9:
        raise ProtocolError("timeout must be a positive number of seconds.", param="timeout")
    return timeout


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None):
    """body[name] checked against kind; JSON null counts as absent. bool is not a number."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        names = " or ".join(_JSON_NAMES[k] for k in kinds)
        raise ProtocolError(f"{name} must be {names}.", status=422, param=name)
    return value


_JSON_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    include_usage = _get(options, "include_usage", bool, False)
    return stream, stream and include_usage


def _parse_prompt(prompt: Any) -> list[PromptType]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if prompt is _MISSING or prompt is None:
        raise ProtocolError("prompt is required.", status=422, param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ProtocolError(
            "prompt must be a string, an array of strings or an array of token ids.",
            status=422,
            param="prompt",
        )
    if all(_is_int(t) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    raise ProtocolError(
        "prompt must be a string, an array of strings, an array of token ids "
        "or an array of token-id arrays.",
        status=422,
        param="prompt",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is _MISSING or messages is None:
        raise ProtocolError("messages is required.", status=422, param="messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError(
            "messages must be a non-empty array of message objects.", status=422, param="messages"
        )
    return [_parse_message(m, i) for i, m in enumerate(messages)]


def _parse_message(message: Any, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ProtocolError(f"{param} must be an object.", status=422, param=param)
    role = message.get("role")
    if not isinstance(role, str):
        raise ProtocolError(f"{param}.role must be a string.", status=422, param=f"{param}.role")
    return {**message, "content": _message_text(message.get("content"), param)}


def _message_text(content: Any, param: str) -> str:
    """String content as is; an array of content parts joined (text parts only)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ProtocolError(
            f"{param}.content must be a string or an array of content parts.",
            status=422,
            param=f"{param}.content",
        )
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
                status=422,
                param=f"{param}.content",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat asks with logprobs: bool and top_logprobs: int; the engine with one int."""
    wanted = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int)
    if top is not None and not wanted:
        raise ProtocolError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    return (top or 0) if wanted else None


def _sampling_params(
    body: dict[str, Any], stream: bool, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "output_kind": RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    }
    for name, kind in _SAMPLING_BODY_FIELDS.items():
        value = _get(body, name, kind)
        if value is not None:
            kwargs[name] = value
    stop = _parse_stop(body.get("stop"))
    if stop is not None:
        kwargs["stop"] = stop
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = _parse_logit_bias(kwargs["logit_bias"])
    for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
        if name in kwargs:
            _check_list(kwargs[name], name, str if name == "bad_words" else int)
    return _build_params(kwargs)


# request field -> JSON type, with SamplingParams' (vLLM's) names
_SAMPLING_BODY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "n": int,
    "best_of": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "logit_bias": dict,
    "min_tokens": int,
    "ignore_eos": bool,
    "stop_token_ids": list,
    "include_stop_str_in_output": bool,
    "skip_special_tokens": bool,
    "prompt_logprobs": int,
    "allowed_token_ids": list,
    "bad_words": list,
}


def _parse_stop(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ProtocolError("stop must be a string or an array of strings.", status=422, param="stop")


def _parse_logit_bias(bias: dict[str, Any]) -> dict[int, float]:
    try:
        return {int(token): float(value) for token, value in bias.items()}
    except (TypeError, ValueError) as e:
        raise ProtocolError(
            "logit_bias must map token ids to numbers.", status=422, param="logit_bias"
        ) from e


def _check_list(values: list[Any], name: str, kind: type) -> None:
    ok = all(isinstance(v, kind) and not isinstance(v, bool) for v in values)
    if not ok:
        raise ProtocolError(
            f"{name} must be an array of {_JSON_NAMES[kind]}s.", status=422, param=name
        )


def _build_params(kwargs: dict[str, Any]) -> SamplingParams:
    """Only the fields this SamplingParams has; out-of-range values become a 400."""
    unsupported = sorted(k for k in kwargs if k not in _SAMPLING_FIELDS)
    if unsupported:
        logger.debug("ignoring sampling fields this engine lacks: %s", ", ".join(unsupported))
    try:
        return SamplingParams(**{k: v for k, v in kwargs.items() if k in _SAMPLING_FIELDS})
    except (ValueError, TypeError) as e:
        raise from_value_error(ValueError(str(e))) from e


def parse_tokenize(body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None, bool]:
    """/tokenize: (prompt, messages, add_special_tokens); exactly one of prompt and messages."""
    prompt = _get(body, "prompt", str)
    messages = body.get("messages")
    if (prompt is None) == (messages is None):
        raise ProtocolError("give either prompt or messages.", status=422, param="prompt")
    if messages is not None:
        messages = _parse_messages(messages)
    return prompt, messages, _get(body, "add_special_tokens", bool, messages is None)


def parse_detokenize(body: dict[str, Any]) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise ProtocolError("tokens must be an array of token ids.", status=422, param="tokens")
    return tokens
