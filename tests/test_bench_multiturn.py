"""bench/multiturn.py: conversations that resend their history, run offline and against a real
`python -m asyncllm.serve` on the tiny model, each turn after the one before."""

from __future__ import annotations

import json

import pytest
from test_server_support import ServerProcess, tiny_server_args

from bench import multiturn

SHAPE = multiturn.ConversationShape(
    num_conversations=40,
    min_turns=2,
    max_turns=5,
    min_len=8,
    max_len=300,
    max_context=1200,
    vocab_size=1000,
)
# small enough for the tiny server (max_model_len 512) to run in seconds
TINY = ["--num-conversations", "3", "--min-turns", "2", "--max-turns", "3", "--min-len", "16"]
TINY += ["--max-len", "24", "--max-context", "256", "--vocab-size", "49152"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("multiturn-server") / "server.log"
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir))
    yield process.start()
    process.stop()


def test_each_turn_resends_the_turn_before_and_its_reply() -> None:
    conversations = multiturn.make_conversations(SHAPE, seed=1)
    assert conversations == multiturn.make_conversations(SHAPE, seed=1)
    assert conversations != multiturn.make_conversations(SHAPE, seed=2)
    for conversation in conversations:
        assert 1 <= len(conversation.turns) <= SHAPE.max_turns
        for before, turn in zip(conversation.turns, conversation.turns[1:]):
            assert turn.prompt[: len(before.prompt)] == before.prompt
            assert len(turn.prompt) >= len(before.prompt) + before.output_len + SHAPE.min_len
        for turn in conversation.turns:
            assert len(turn.prompt) + turn.output_len <= SHAPE.max_context
            assert all(100 <= token < SHAPE.vocab_size for token in turn.prompt)


def test_the_context_limit_ends_a_conversation_early() -> None:
    conversations = multiturn.make_conversations(SHAPE, seed=1)
    assert any(len(c.turns) < SHAPE.max_turns for c in conversations)
    assert max(len(c.turns) for c in conversations) == SHAPE.max_turns


def test_requests_go_by_turn() -> None:
    conversations = multiturn.make_conversations(SHAPE, seed=1)
    requests = multiturn.by_turn(conversations)
    assert requests[: len(conversations)] == [c.turns[0] for c in conversations]
    assert len(requests) == sum(len(c.turns) for c in conversations)


def test_served_turns_find_their_history_cached(server, tiny_model_dir, tmp_path) -> None:
    offline = tmp_path / "offline.json"
    multiturn.main(["offline", *TINY, "--model", str(tiny_model_dir), "--max-model-len", "512",
                    "--out", str(offline)])  # fmt: skip
    out = tmp_path / "served.json"
    multiturn.main(["serve", *TINY, "--base-url", server.url, "--offline", str(offline),
                    "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    turns = result["workload"]["turns"]
    for run in result["runs"].values():
        assert run["completed"] == turns and run["failed"] == 0, run["errors"]
        # every later turn finds at least the first block of its conversation's history
        assert run["prefix_cache_hit_rate"] > 0
        assert run["median_ttft_first_turn_ms"] > 0 and run["median_ttft_later_turns_ms"] > 0
    assert result["runs"]["half_load"]["conversation_rate"] == pytest.approx(
        result["runs"]["saturation"]["conversation_throughput"] / 2
    )
    assert result["offline"]["output_throughput"] > 0 and result["serving_over_offline"] > 0
