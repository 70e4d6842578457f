"""Every request field of every route, in one table: the parser checks bodies against it and
/openapi.json is built from it. SamplingParams enforces the ranges of the fields it takes (a test
keeps the table and it in agreement); the server checks the ranges of its own fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Schema = dict[str, Any]

COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = "completions", "chat", "tokenize", "detokenize"
RESPONSES = "responses"
GENERATION = (COMPLETIONS, CHAT)

_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "string": (str,),
    "array": (list,),
    "object": (dict,),
}
_ARTICLES = {"integer": "an integer", "array": "an array", "object": "an object"}


def is_json_type(value: Any, json_type: str) -> bool:
    """bool is not a number in JSON, though it is an int in Python."""
    if isinstance(value, bool):
        return json_type == "boolean"
    return isinstance(value, _PYTHON_TYPES[json_type])


def type_name(json_type: str) -> str:
    return _ARTICLES.get(json_type, f"a {json_type}")


@dataclass(frozen=True)
class Field:
    name: str  # as it is on the wire
    type: str | tuple[str, ...]  # its JSON type, or the alternatives
    description: str
    routes: tuple[str, ...] = GENERATION
    param: str | None = None  # the SamplingParams attribute it sets; None: the server's own
    minimum: float | None = None  # of the number, or of each number an array or object holds
    maximum: float | None = None
    exclusive_minimum: bool = False
    items: str | None = None  # the JSON type of an array's items or an object's values
    default: Any = None
    required: bool = False
    members: tuple[Field, ...] = ()  # an object's own fields
    schema: Schema | None = None  # the whole schema, where the shape is more than a type

    @property
    def types(self) -> tuple[str, ...]:
        return self.type if isinstance(self.type, tuple) else (self.type,)

    def accepts(self, value: Any) -> bool:
        """Whether the value has this field's JSON type (and its items theirs)."""
        if not any(is_json_type(value, t) for t in self.types):
            return False
        if self.items is None or not isinstance(value, list | dict):
            return True
        elements = value.values() if isinstance(value, dict) else value
        return all(is_json_type(v, self.items) for v in elements)

    def type_text(self) -> str:
        names = [type_name(t) for t in self.types]
        if self.items is not None:
            container = "an array" if "array" in self.types else "an object"
            of = f"{container} of {self.items}s"
            names = [of if n == container else n for n in names]
        return " or ".join(names)

    @property
    def has_range(self) -> bool:
        return self.minimum is not None or self.maximum is not None

    def in_range(self, value: Any) -> bool:
        """Whether the number, or every number the array or object holds, is in range."""
        if isinstance(value, list | dict):
            return all(map(self.in_range, value.values() if isinstance(value, dict) else value))
        low = self.minimum
        if low is not None and (value < low or (self.exclusive_minimum and value == low)):
            return False
        return self.maximum is None or value <= self.maximum

    def range_text(self) -> str:
        low = "(" if self.exclusive_minimum else "["
        low += "-inf" if self.minimum is None else f"{self.minimum:g}"
        high = "inf)" if self.maximum is None else f"{self.maximum:g}]"
        return f"in {low}, {high}"

    def json_schema(self) -> Schema:
        if self.schema is not None:
            schema = dict(self.schema)
        else:
            alternatives = [self._type_schema(t) for t in self.types]
            schema = alternatives[0] if len(alternatives) == 1 else {"oneOf": alternatives}
        if self.default is not None:
            schema["default"] = self.default
        return {**schema, "description": self.description}

    def _type_schema(self, json_type: str) -> Schema:
        schema: Schema = {"type": json_type}
        if json_type in ("integer", "number") and self.items is None:
            schema.update(self._range_schema())
        elif json_type == "array" and self.items is not None:
            schema["items"] = {"type": self.items, **self._range_schema()}
        elif json_type == "object" and self.items is not None:
            schema["additionalProperties"] = {"type": self.items, **self._range_schema()}
        elif json_type == "object" and self.members:
            schema["properties"] = {m.name: m.json_schema() for m in self.members}
            required = [m.name for m in self.members if m.required]
            if required:
                schema["required"] = required
        return schema

    def _range_schema(self) -> Schema:
        schema: Schema = {}
        if self.minimum is not None:
            schema["minimum"] = self.minimum
            if self.exclusive_minimum:
                schema["exclusiveMinimum"] = True  # OpenAPI 3.0: a flag on minimum
        if self.maximum is not None:
            schema["maximum"] = self.maximum
        return schema


def fields_for(route: str) -> list[Field]:
    return [f for f in FIELDS if route in f.routes]


TOKEN_IDS: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_PROMPT_SCHEMA: Schema = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {**TOKEN_IDS, "minItems": 1},
        {"type": "array", "items": {**TOKEN_IDS, "minItems": 1}, "minItems": 1},
    ]
}
_MESSAGES_SCHEMA: Schema = {
    "type": "array",
    "items": {"$ref": "#/components/schemas/ChatMessage"},
    "minItems": 1,
}
_CONTENT_PART: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
}
MESSAGE_FIELDS = (
    Field(
        "role",
        "string",
        "user, assistant, system, tool, or a role of the chat template's own",
        required=True,
        schema={"type": "string", "minLength": 1},
    ),
    Field(
        "content",
        ("string", "array"),
        "text, or text content parts; only an assistant message may leave it out",
        schema={
            "oneOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART}],
            "nullable": True,
        },
    ),
    Field("name", "string", "the author's name, for the chat template"),
)
_STREAM_OPTIONS = (
    Field("include_usage", "boolean", "end the stream with a chunk holding the usage"),
    Field(
        "continuous_usage_stats",
        "boolean",
        "with include_usage, every chunk holds the usage so far (vLLM)",
    ),
    Field(
        "resumable",
        "boolean",
        "keep generating if the connection drops (for --stream-retention seconds); resume with "
        "GET /v1/streams/{id} and Last-Event-ID",
    ),
)

_RESPONSES = (RESPONSES,)
RESPONSES_FIELDS = (
    Field(
        "input",
        ("string", "array"),
        "a user message, or message items (text content)",
        routes=_RESPONSES,
        required=True,
    ),
    Field("model", "string", "the served model's name; another name is a 404", routes=_RESPONSES),
    Field("instructions", "string", "a system message before the input", routes=_RESPONSES),
    Field(
        "previous_response_id",
        "string",
        "continue the conversation of this stored response",
        routes=_RESPONSES,
    ),
    Field("max_output_tokens", "integer", "tokens to generate at most", routes=_RESPONSES),
    Field("temperature", "number", "0: greedy", routes=_RESPONSES),
    Field("top_p", "number", "nucleus sampling", routes=_RESPONSES),
    Field("stream", "boolean", "answer with the SSE stream of events", routes=_RESPONSES),
    Field(
        "background",
        "boolean",
        "answer at once and generate on (resumable; poll, stream or cancel it by id)",
        routes=_RESPONSES,
    ),
    Field("store", "boolean", "keep the response for retrieval (default true)", routes=_RESPONSES),
    Field("metadata", "object", "string pairs stored with the response", routes=_RESPONSES),
)

_STRUCTURED_OUTPUTS = (
    Field("json", ("object", "string"), "a JSON schema the output follows"),
    Field("regex", "string", "a regular expression the whole output matches"),
    Field("choice", "array", "the output is one of these strings", items="string"),
    Field("grammar", "string", "an EBNF grammar the output follows"),
    Field("json_object", "boolean", "the output is a JSON object"),
)
_RESPONSE_FORMAT = (
    Field(
        "type",
        "string",
        "text, json_object or json_schema",
        required=True,
        schema={"type": "string", "enum": ["text", "json_object", "json_schema"]},
    ),
    Field(
        "json_schema",
        "object",
        "with type json_schema: name, schema (the JSON schema the output follows) and strict",
    ),
)

FIELDS: tuple[Field, ...] = (
    Field(
        "prompt",
        ("string", "array"),
        "a string, strings, token ids or token-id arrays: one choice per prompt and per n",
        routes=(COMPLETIONS,),
        required=True,
        schema=_PROMPT_SCHEMA,
    ),
    Field(
        "messages",
        "array",
        "the conversation, rendered by the model's chat template",
        routes=(CHAT,),
        required=True,
        schema=_MESSAGES_SCHEMA,
    ),
    Field("model", "string", "the served model's name; another name is a 404"),
    Field("stream", "boolean", "answer with an SSE stream of chunks", default=False),
    Field("stream_options", "object", "options of a stream", members=_STREAM_OPTIONS),
    Field(
        "max_tokens",
        "integer",
        "tokens to generate at most",
        routes=(COMPLETIONS,),
        param="max_tokens",
        minimum=1,
        default=16,
    ),
    Field(
        "max_tokens",
        "integer",
        "tokens to generate at most; default: the rest of the context",
        routes=(CHAT,),
        param="max_tokens",
        minimum=1,
    ),
    Field(
        "max_completion_tokens",
        "integer",
        "max_tokens by its newer name; wins over max_tokens",
        routes=(CHAT,),
        param="max_tokens",
        minimum=1,
    ),
    Field(
        "n",
        "integer",
        "choices per prompt (a request holds at most 128 choices)",
        param="n",
        minimum=1,
    ),
    Field(
        "best_of",
        "integer",
        "samples per prompt, of which the n most likely are returned",
        param="best_of",
        minimum=1,
    ),
    Field("temperature", "number", "0: greedy", param="temperature", minimum=0),
    Field(
        "top_p",
        "number",
        "nucleus sampling: the smallest set of tokens holding this probability",
        param="top_p",
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
    ),
    Field("top_k", "integer", "the k most likely tokens; -1 or 0: all", param="top_k", minimum=-1),
    Field(
        "min_p",
        "number",
        "tokens below this fraction of the most likely token's probability are dropped",
        param="min_p",
        minimum=0,
        maximum=1,
    ),
    Field(
        "seed",
        "integer",
        "makes sampling reproducible (a signed 64-bit integer)",
        param="seed",
        minimum=-(2**63),
        maximum=2**63 - 1,
    ),
    Field(
        "presence_penalty",
        "number",
        "subtracted from the logits of tokens already generated",
        param="presence_penalty",
        minimum=-2,
        maximum=2,
    ),
    Field(
        "frequency_penalty",
        "number",
        "subtracted per occurrence of a token already generated",
        param="frequency_penalty",
        minimum=-2,
        maximum=2,
    ),
    Field(
        "repetition_penalty",
        "number",
        "divides the logits of tokens in the prompt or the output; 1: none",
        param="repetition_penalty",
        minimum=0,
        exclusive_minimum=True,
    ),
    Field(
        "logit_bias",
        "object",
        "token id (as a string) -> a bias added to its logit",
        param="logit_bias",
        items="number",
        minimum=-100,
        maximum=100,
    ),
    Field(
        "min_tokens",
        "integer",
        "tokens to generate before EOS or stop token ids may end the output",
        param="min_tokens",
        minimum=0,
    ),
    Field("ignore_eos", "boolean", "keep generating past EOS", param="ignore_eos"),
    Field(
        "stop",
        ("string", "array"),
        "strings that end the output (left out of it)",
        param="stop",
        items="string",
    ),
    Field(
        "stop_token_ids",
        "array",
        "token ids that end the output",
        param="stop_token_ids",
        items="integer",
        minimum=0,
    ),
    Field(
        "include_stop_str_in_output",
        "boolean",
        "keep the stop string in the output",
        param="include_stop_str_in_output",
    ),
    Field(
        "skip_special_tokens",
        "boolean",
        "leave special tokens out of the text",
        param="skip_special_tokens",
    ),
    Field(
        "echo",
        "boolean",
        "the prompt's text before the completion; in chat, the last message's content when it "
        "is the assistant's",
        default=False,
    ),
    Field(
        "logprobs",
        "integer",
        "the logprob of each token with this many alternatives (at most --max-logprobs); -1: "
        "the whole vocabulary",
        routes=(COMPLETIONS,),
        param="logprobs",
        minimum=0,
    ),
    Field("logprobs", "boolean", "the logprob of each output token", routes=(CHAT,)),
    Field(
        "top_logprobs",
        "integer",
        "alternatives per token, with logprobs: true (at most --max-logprobs); -1: the whole "
        "vocabulary",
        routes=(CHAT,),
        param="logprobs",
        minimum=0,
    ),
    Field(
        "prompt_logprobs",
        "integer",
        "the logprob of each prompt token with this many alternatives",
        param="prompt_logprobs",
        minimum=0,
    ),
    Field(
        "allowed_token_ids",
        "array",
        "sample only among these token ids",
        param="allowed_token_ids",
        items="integer",
        minimum=0,
    ),
    Field(
        "bad_words",
        "array",
        "words the output must not contain",
        param="bad_words",
        items="string",
    ),
    Field(
        "tools",
        "array",
        "functions the model may call, rendered by the chat template",
        routes=(CHAT,),
        items="object",
    ),
    Field(
        "tool_choice",
        ("string", "object"),
        "none, auto (needs --tool-call-parser), required, or {type: function, function: {name}}",
        routes=(CHAT,),
    ),
    Field(
        "parallel_tool_calls",
        "boolean",
        "with tool_choice required, the reply may call more than one function",
        routes=(CHAT,),
        default=True,
    ),
    Field(
        "response_format",
        "object",
        "OpenAI's structured outputs: a JSON object, or JSON following a schema",
        members=_RESPONSE_FORMAT,
    ),
    Field(
        "structured_outputs",
        "object",
        "vLLM's structured outputs: exactly one of json, regex, choice, grammar, json_object",
        param="structured_outputs",
        members=_STRUCTURED_OUTPUTS,
    ),
    Field(
        "chat_template_kwargs",
        "object",
        "variables for the chat template",
        routes=(CHAT,),
    ),
    Field(
        "add_generation_prompt",
        "boolean",
        "end the rendered messages with the template's opening of an assistant reply",
        routes=(CHAT, TOKENIZE),
        default=True,
    ),
    Field(
        "continue_final_message",
        "boolean",
        "leave the last message, the assistant's, open for the reply to continue (no end of "
        "turn); needs add_generation_prompt: false",
        routes=(CHAT, TOKENIZE),
        default=False,
    ),
    Field("priority", "integer", "lower runs first under --scheduling-policy priority"),
    Field(
        "timeout",
        "number",
        "seconds the whole request may take, queue included; then 408",
        minimum=0,
        exclusive_minimum=True,
        maximum=1e9,
    ),
    Field("prompt", "string", "the text to tokenize (or messages)", routes=(TOKENIZE,)),
    Field(
        "messages",
        "array",
        "a conversation to render and tokenize (or prompt)",
        routes=(TOKENIZE,),
        schema=_MESSAGES_SCHEMA,
    ),
    Field(
        "add_special_tokens",
        "boolean",
        "add the tokenizer's special tokens; default: true for a prompt, false for messages",
        routes=(TOKENIZE,),
    ),
    Field(
        "return_token_strs",
        "boolean",
        "also return each token's string (token_strs)",
        routes=(TOKENIZE,),
        default=False,
    ),
    Field(
        "tokens",
        "array",
        "token ids to turn into text",
        routes=(DETOKENIZE,),
        items="integer",
        minimum=0,
        required=True,
    ),
    *RESPONSES_FIELDS,
)
