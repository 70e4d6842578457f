"""<think> reasoning kept apart from the answer, whole and streamed in random chunk sizes."""

from __future__ import annotations

import pytest
from test_parsers_support import streamed

from asyncllm.server.reasoning_parsers import reasoning_parser

# parser, output, reasoning, content
CASES = [
    (
        "qwen3",
        "<think>\nThe user greets me.\n</think>\n\nHello!",
        "\nThe user greets me.\n",
        "\n\nHello!",
    ),
    ("qwen3", "Hello, no thinking here.", None, "Hello, no thinking here."),
    ("qwen3", "<think>cut off before the end", "cut off before the end", ""),
    ("qwen3", "a < b and </think> is just text", None, "a < b and </think> is just text"),
    ("deepseek_r1", "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", "<think>opened anyway</think>4", "opened anyway", "4"),
    ("deepseek_r1", "still thinking <", "still thinking <", ""),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_whole_output(parser, text, reasoning, content) -> None:
    assert reasoning_parser(parser).parse(text) == (reasoning, content)


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_stream_in_random_chunks_equals_the_whole_parse(parser, text, reasoning, content) -> None:
    for seed in range(20):
        deltas = streamed(reasoning_parser(parser).stream(), text, seed, max_chunk=5)
        assert "".join(r for r, _ in deltas) == (reasoning or "")
        assert "".join(c for _, c in deltas) == content


def test_unknown_reasoning_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_parser("nope")
