"""RequestOutputs -> OpenAI's response objects: the chunks of a stream, or the final response."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from asyncllm.outputs import CompletionOutput, RequestOutput
from asyncllm.server.chat_message import ChatMessageStream, message
from asyncllm.server.logprobs import CompletionLogprobs, Entry, LogprobFormatter
from asyncllm.server.protocol import GenerationRequest


@dataclass
class Usage:
    completion_tokens: int = 0
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # per prompt
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per prompt: prefix cache hits

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        cached = max(self.cached_tokens.get(prompt_index, 0), output.num_cached_tokens)
        self.cached_tokens[prompt_index] = cached
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def as_dict(self) -> dict[str, Any]:
        prompt_tokens = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }


class ChunkBuilder:
    """RequestOutputs -> OpenAI chunk objects (streaming) or the final response object."""

    def __init__(self, req: GenerationRequest, response_id: str, model: str, tokenizer) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.usage = Usage()
        self.chat = req.kind == "chat"
        self.logprobs = LogprobFormatter(tokenizer, req.logprobs or 0)
        self.started: set[int] = set()  # choice indices with a chunk out
        self.text_offsets: dict[int, int] = {}  # per choice, where its next token starts
        self.prompt_logprobs: dict[int, list[Entry | None]] = {}  # per prompt, once they came
        self.prompt_logprobs_sent: set[int] = set()  # choice indices
        self.shaped = self.chat and not req.message_shape.plain
        self.messages: dict[int, ChatMessageStream] = {}  # per choice, with self.shaped

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        output = self._visible(prompt_index, output)
        self.usage.add(prompt_index, output)
        chunks = []
        for completion in output.outputs:
            index = prompt_index * self.req.params.n + completion.index
            chunks += self._choice_chunks(index, prompt_index, output, completion)
        return chunks

    def _choice_chunks(
        self, index: int, prompt_index: int, output: RequestOutput, completion: CompletionOutput
    ) -> list[dict[str, Any]]:
        first = index not in self.started
        self.started.add(index)
        chunks = []
        text = completion.text
        if self.chat and first:
            chunks.append(self._chunk(index, prompt_index, {"role": "assistant", "content": ""}))
        echo = first and self.req.echo
        if echo:
            text = self._echo_text(output) + text
        logprobs = self._logprobs(index, prompt_index, output, completion, echo)
        if self.shaped:
            return chunks + self._shaped_chunks(index, prompt_index, text, logprobs, completion)
        if text or logprobs is not None:
            delta = {"content": text} if self.chat else text
            chunks.append(self._chunk(index, prompt_index, delta, logprobs))
        if completion.finish_reason is not None:
            empty = {} if self.chat else ""
            chunks.append(self._chunk(index, prompt_index, empty, None, completion))
        return chunks

    def _shaped_chunks(
        self,
        index: int,
        prompt_index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        completion: CompletionOutput,
    ) -> list[dict[str, Any]]:
        """Chat deltas with reasoning_content and tool_calls apart from the content."""
        stream = self.messages.setdefault(index, ChatMessageStream(self.req.message_shape))
        chunks = []
        delta = stream.feed(text)
        if delta or logprobs is not None:
            chunks.append(self._chunk(index, prompt_index, delta, logprobs))
        if completion.finish_reason is not None:
            rest = stream.finish()
            if rest:
                chunks.append(self._chunk(index, prompt_index, rest))
            finished = _called(completion) if stream.called else completion
            chunks.append(self._chunk(index, prompt_index, {}, None, finished))
        return chunks

    def _chunk(
        self,
        index: int,
        prompt_index: int,
        delta: dict[str, Any] | str,
        logprobs: dict[str, Any] | None = None,
        finished: CompletionOutput | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        choice["delta" if self.chat else "text"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finished.finish_reason if finished else None
        if finished is not None:
            choice["stop_reason"] = finished.stop_reason
        if self._prompt_logprobs_due(index, prompt_index):
            self.prompt_logprobs_sent.add(index)
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt_index)
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = [choice]
        if self.req.include_usage:
            chunk["usage"] = self.usage.as_dict() if self.req.continuous_usage else None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = []
        chunk["usage"] = self.usage.as_dict()
        return chunk

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for prompt_index, output in enumerate(outputs):
            output = self._visible(prompt_index, output)
            self.usage.add(prompt_index, output)
            for completion in output.outputs:
                index = prompt_index * self.req.params.n + completion.index
                choices.append(self._final_choice(index, prompt_index, output, completion))
        response = self._envelope("chat.completion" if self.chat else "text_completion")
        response["choices"] = sorted(choices, key=lambda c: c["index"])
        response["usage"] = self.usage.as_dict()
        return response

    def _final_choice(
        self, index: int, prompt_index: int, output: RequestOutput, completion: CompletionOutput
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        text = (self._echo_text(output) if self.req.echo else "") + completion.text
        if self.shaped:
            choice["message"] = message(self.req.message_shape, text)
            if choice["message"].get("tool_calls"):
                completion = _called(completion)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(index, prompt_index, output, completion, self.req.echo)
        choice["finish_reason"] = completion.finish_reason
        choice["stop_reason"] = completion.stop_reason
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt_index)
        return choice

    def _visible(self, prompt_index: int, output: RequestOutput) -> RequestOutput:
        """Keeps the prompt logprobs of the prompt when they come; with echo_only, the one token
        generated to score the prompt is left out of the answer."""
        if output.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(prompt_index, output.prompt_logprobs)
        if not self.req.echo_only:
            return output
        return replace(output, outputs=[_without_tokens(c) for c in output.outputs])

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def _echo_text(self, output: RequestOutput) -> str:
        """Completions echo the prompt; chat the last message, when it is the assistant's (whose
        reply continues it), as vLLM does."""
        if not self.chat:
            return self._prompt_text(output)
        last = (self.req.messages or [{}])[-1]
        return last["content"] if last.get("role") == "assistant" else ""

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer else ""

    def _prompt_logprobs_due(self, index: int, prompt_index: int) -> bool:
        """A stream sends a choice its prompt's logprobs once, in its first chunk after they
        came."""
        asked = self.req.prompt_logprobs is not None
        return (
            asked
            and index not in self.prompt_logprobs_sent
            and prompt_index in self.prompt_logprobs
        )

    def _prompt_logprobs(self, prompt_index: int) -> list[dict[str, Any] | None] | None:
        entries = self.prompt_logprobs.get(prompt_index)
        return None if entries is None else self.logprobs.prompt_logprobs(entries)

    def _logprobs(
        self,
        index: int,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        echo: bool,
    ) -> dict[str, Any] | None:
        if self.req.logprobs is None or completion.logprobs is None:
            return None
        # a delta holds the logprobs of its own tokens; a cumulative list ends with them
        entries = completion.logprobs[len(completion.logprobs) - len(completion.token_ids) :]
        pairs = list(zip(completion.token_ids, entries))
        if self.chat:
            return self.logprobs.chat(pairs)
        logprobs = CompletionLogprobs(self.text_offsets.get(index, 0))
        if echo:
            self._add_prompt(logprobs, prompt_index, output)
        for token_id, entry in pairs:
            self.logprobs.add_completion(logprobs, token_id, entry)
        self.text_offsets[index] = logprobs.offset
        return logprobs.as_dict()

    def _add_prompt(
        self, logprobs: CompletionLogprobs, prompt_index: int, output: RequestOutput
    ) -> None:
        """The echoed prompt's tokens; the output's offsets then start after its text."""
        token_ids = output.prompt_token_ids
        entries = self.prompt_logprobs.get(prompt_index) or [None] * len(token_ids)
        for token_id, entry in zip(token_ids, entries):
            self.logprobs.add_completion(logprobs, token_id, entry)
        logprobs.offset = len(self._prompt_text(output))


def _called(completion: CompletionOutput) -> CompletionOutput:
    """A reply that ended with tool calls finishes with reason tool_calls, as OpenAI's do."""
    if completion.finish_reason != "stop":
        return completion
    return replace(completion, finish_reason="tool_calls")


def _without_tokens(completion: CompletionOutput) -> CompletionOutput:
    return replace(
        completion,
        text="",
        token_ids=[],
        logprobs=None if completion.logprobs is None else [],
        finish_reason="length" if completion.finished else None,
        stop_reason=None,
    )
