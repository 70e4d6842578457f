"""Incremental detokenization with stop strings, on top of tokenizers' DecodeStream."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# Prompt tokens tried as decoding context; a few suffice to get a leading space right.
MAX_PRIME_TOKENS = 8
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, one step at a time.

    Invariant: the text produced equals decoding the prompt's clean tail plus all output ids at
    once, minus the tail's own text. For byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) that is
    exactly `tokenizer.decode(output_ids)`; for SentencePiece-style decoders it keeps the leading
    space of the first output token, which decoding the output alone would strip.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = backend_tokenizer(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        prime = clean_suffix(self._tokenizer, prompt_token_ids, skip_special_tokens)
        self._stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
        # Ids of the last step that produced text, and ids fed since: enough to flush the stream.
        self._anchor_ids = prime
        self._held_ids: list[int] = []
        self._stop = tuple(s for s in stop or () if s)
        self._include_stop = include_stop_str_in_output
        self._holdback = max(map(len, self._stop), default=1) - 1
        self._parts: list[str] = []
        self._len = 0
        self._sent = 0
        self.stop_reason: str | None = None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    @property
    def output_text(self) -> str:
        text = "".join(self._parts)
        self._parts = [text] if text else []
        return text

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Feeds new tokens; returns the stop string if one just completed."""
        if self.stop_reason is not None or not new_token_ids:
            return None
        ids = list(new_token_ids)
        text = self._stream.step(self._tokenizer, ids)
        if text is None:
            self._held_ids += ids
            return None
        self._anchor_ids = self._held_ids + ids
        self._held_ids = []
        return self._append(text)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to emit now; holds back a possible stop-string prefix until finished.

        After a call with finished=True the detokenizer takes no more tokens.
        """
        if finished:
            self._flush()
        end = self._len if finished else max(self._len - self._holdback, 0)
        if not delta:
            return self.output_text[:end]
        if end <= self._sent:
            return ""
        text = self._suffix(self._sent)[: end - self._sent]
        self._sent = end
        return text

    def _append(self, text: str) -> str | None:
        if not self._stop:
            self._add(text)
            return None
        old = self._suffix(self._len - self._holdback)
        window = old + text
        self._add(text)
        match = find_stop(window, len(old), self._stop)
        if match is None:
            return None
        stop, start = match
        cut = start + len(stop) if self._include_stop else start
        self._truncate(len(window) - cut)
        self.stop_reason = stop
        return stop

    def _flush(self) -> None:
        """Releases ids the stream still holds back as an incomplete character."""
        if not self._held_ids or self.stop_reason is not None:
            return
        head = self._decode(self._anchor_ids)
        full = self._decode(self._anchor_ids + self._held_ids)
        self._held_ids = []
        text = full[len(head) :] if full.startswith(head) else full
        if text:
            self._append(text)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _add(self, text: str) -> None:
        self._parts.append(text)
        self._len += len(text)

    def _suffix(self, start: int) -> str:
        """Text from char offset `start` on, joining only the parts it spans."""
        start = max(start, 0)
        pos, pieces = self._len, []
        for part in reversed(self._parts):
            if pos <= start:
                break
            pieces.append(part)
            pos -= len(part)
        return "".join(reversed(pieces))[start - pos :]

    def _truncate(self, n: int) -> None:
        """Drops the last n chars of text."""
        self._len -= n
        while n > 0:
            last = self._parts.pop()
            if len(last) > n:
                self._parts.append(last[: len(last) - n])
            n -= len(last)


def backend_tokenizer(tokenizer: PreTrainedTokenizerBase | Tokenizer) -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(
            f"{type(tokenizer).__name__} has no fast (tokenizers) backend; "
            "incremental detokenization needs a fast tokenizer"
        )
    return backend


def clean_suffix(tokenizer: Tokenizer, ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """The shortest prompt tail that decodes to whole characters, or [] if there is none.

    DecodeStream re-emits its priming ids' text when that text ends in a partial character.
    """
    for n in range(1, min(len(ids), MAX_PRIME_TOKENS) + 1):
        tail = list(ids[-n:])
        text = tokenizer.decode(tail, skip_special_tokens=skip_special_tokens)
        if text and REPLACEMENT_CHAR not in text:
            return tail
    return []


def find_stop(text: str, searched: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The stop string that completes first in `text` after its first `searched` chars.

    Returns (stop, start index); ties on the end go to the longer stop.
    """
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(searched - len(stop) + 1, 0))
        if start == -1:
            continue
        found = (start + len(stop), start, stop)
        if best is None or found < best:
            best = found
    return None if best is None else (best[2], best[1])
