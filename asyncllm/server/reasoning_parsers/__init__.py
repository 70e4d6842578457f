"""Reasoning parsers chosen by --reasoning-parser: <think>...</think> kept apart from the answer.

A stream splits the whole text so far at every piece (text that may still become the end tag
held back), so it assembles to exactly the whole output's parse.
qwen3: reasoning only when the output opens with <think>. deepseek_r1: the template opened the
thinking, so the output is reasoning up to </think> (a leading <think> is dropped).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from asyncllm.sampling_params import ReasoningMarkers, SamplingParams

START, END = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str
    content: str


class ThinkReasoningParser:
    def __init__(self, opens_without_tag: bool) -> None:
        self.opens_without_tag = opens_without_tag

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """The settled reasoning and content of text; with final, all of it is settled."""
        opening = text.lstrip()
        if not final and START.startswith(opening) and len(opening) < len(START):
            return ReasoningSplit("", "")  # may still open with the tag
        if opening.startswith(START):
            return self._thinking(text, len(text) - len(opening) + len(START), final)
        if self.opens_without_tag:
            return self._thinking(text, 0, final)
        return ReasoningSplit("", text)

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content); reasoning None when the output has none."""
        split = self.split(text, final=True)
        return split.reasoning or None, split.content

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def _thinking(self, text: str, start: int, final: bool) -> ReasoningSplit:
        end = text.find(END, start)
        if end >= 0:
            return ReasoningSplit(text[start:end], text[end + len(END) :])
        stop = len(text) if final else len(text) - _held_back(text[start:], END)
        return ReasoningSplit(text[start:stop], "")


def _held_back(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """Text in as it arrives, (reasoning, content) deltas out: each feed splits the whole text
    so far and gives what grew (a settled split only ever grows)."""

    def __init__(self, parser: ThinkReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ReasoningSplit("", "")

    def feed(self, text: str) -> tuple[str, str]:
        return self._settle(text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._settle("", final=True)

    def _settle(self, text: str, final: bool) -> tuple[str, str]:
        self.text += text
        split = self.parser.split(self.text, final)
        sent, self.sent = self.sent, split
        return split.reasoning[len(sent.reasoning) :], split.content[len(sent.content) :]


REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}


def reasoning_parser(name: str) -> ThinkReasoningParser:
    if name not in REASONING_PARSERS:
        choices = ", ".join(REASONING_PARSERS)
        raise ValueError(f"--reasoning-parser must be one of {choices}; got {name!r}.")
    return ThinkReasoningParser(opens_without_tag=REASONING_PARSERS[name])


def constrain_the_answer(params: SamplingParams, name: str, tokenizer) -> None:
    """A structured-outputs constraint holds from the end of the reasoning on: the tags in the
    tokenizer's ids go with it to the engine."""
    if params.structured_outputs is None:
        return

    def ids(tag: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(tag, add_special_tokens=False))

    markers = ReasoningMarkers(ids(START), ids(END), not REASONING_PARSERS[name])
    params.structured_outputs = dataclasses.replace(params.structured_outputs, reasoning=markers)
