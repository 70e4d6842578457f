"""The engine's logprobs ({token id: Logprob} per position, the actual token with its own rank
beside the top N) in the shapes clients read: OpenAI's completions and chat objects, and vLLM's
prompt_logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.outputs import Logprob

Entry = dict[int, Logprob]


@dataclass
class CompletionLogprobs:
    """OpenAI's completions `logprobs` object, one position at a time; `offset` is where the
    next token starts in the choice's text."""

    offset: int = 0

    def __post_init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(token)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class LogprobFormatter:
    """Token strings come from the engine's decoded_token, else from the tokenizer."""

    def __init__(self, tokenizer: Any, top_n: int) -> None:
        self.tokenizer = tokenizer
        self.top_n = top_n

    def ranked(self, token_id: int, entry: Entry) -> list[tuple[int, Logprob]]:
        """The top N alternatives plus the actual token where it is not among them, most likely
        first (as OpenAI and vLLM return them)."""
        kept = [(t, lp) for t, lp in entry.items() if t == token_id or _rank(lp) <= self.top_n]
        return sorted(kept, key=lambda item: -item[1].logprob)

    def add_completion(
        self, logprobs: CompletionLogprobs, token_id: int, entry: Entry | None
    ) -> None:
        """One position; no entry for a prompt's first token, which nothing predicts."""
        token = self.token(token_id, entry)
        if entry is None:
            logprobs.add(token, None, None)
            return
        top = {self.token(t, entry): lp.logprob for t, lp in self.ranked(token_id, entry)}
        logprobs.add(token, _logprob_of(token_id, entry), top)

    def chat(self, pairs: list[tuple[int, Entry]]) -> dict[str, Any]:
        return {"content": [self._chat_token(t, e) for t, e in pairs]}

    def _chat_token(self, token_id: int, entry: Entry) -> dict[str, Any]:
        token = self.token(token_id, entry)
        top = [
            {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}
            for text, lp in ((self.token(t, entry), lp) for t, lp in self.ranked(token_id, entry))
        ]
        return {
            "token": token,
            "logprob": _logprob_of(token_id, entry),
            "bytes": list(token.encode()),
            "top_logprobs": top,
        }

    def prompt_logprobs(self, entries: list[Entry | None]) -> list[dict[str, Any] | None]:
        """vLLM's shape: per prompt token, None for the first, else token id (a string key) ->
        {logprob, rank, decoded_token}."""
        return [
            None
            if entry is None
            else {
                str(t): {
                    "logprob": lp.logprob,
                    "rank": lp.rank,
                    "decoded_token": self.token(t, entry),
                }
                for t, lp in entry.items()
            }
            for entry in entries
        ]

    def token(self, token_id: int, entry: Entry | None) -> str:
        logprob = entry.get(token_id) if entry is not None else None
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)


def _rank(logprob: Logprob) -> int:
    return logprob.rank if logprob.rank is not None else 1


_MISSING_LOGPROB = -9999.0  # vLLM's stand-in for a token outside the returned top-N


def _logprob_of(token_id: int, entry: Entry) -> float:
    logprob = entry.get(token_id)
    return logprob.logprob if logprob is not None else _MISSING_LOGPROB
