"""The worker's grammar matchers on a small raw vocabulary: the batched fill on its own thread
gives, row for row, the mask each request's own matcher fills one at a time, and it waits for
the step before without holding up the launch."""

import json
import random
import threading

import pytest
import torch
import xgrammar as xgr

from asyncllm.structured_output.matchers import ConstrainedRow, GrammarMatchers

VOCAB = ["{", "}", '"', "a", "b", "ab", ":", ",", " ", "1", "2", "true", "false", "[", "]", "</s>"]
EOS = len(VOCAB) - 1
NUM_SAMPLING_ROWS = 6
ROWS = [0, 1, 3, 4, 5]  # sampling row 2 samples freely
# where each row's logits sit when sampling row 2 verifies 3 drafts
LOGITS_ROWS = [0, 1, 6, 7, 8]
NUM_LOGITS_ROWS = 9


@pytest.fixture(scope="module")
def grammars() -> list[xgr.CompiledGrammar]:
    info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)
    schemas = [
        {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        {"type": "object", "properties": {"ab": {"enum": ["a", "b"]}}, "required": ["ab"]},
    ]
    compiled = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False) for s in schemas]
    return [*compiled, compiler.compile_regex("(ab|1)+2"), compiler.compile_grammar('root ::= "a"')]


def allowed_ids(words: torch.Tensor) -> list[int]:
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return [i for i in bits.flatten().nonzero().flatten().tolist() if i < len(VOCAB)]


def reference_mask(matcher: xgr.GrammarMatcher) -> torch.Tensor:
    mask = xgr.allocate_token_bitmask(1, len(VOCAB))
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(mask)
    return mask[0]


class HeldStep:
    """A launched step's event that happens when the test says so."""

    def __init__(self) -> None:
        self.ran = threading.Event()
        self.waited_on: str | None = None

    def synchronize(self) -> None:
        self.waited_on = threading.current_thread().name
        assert self.ran.wait(10)


def test_batched_fill_equals_each_matcher_filled_alone(grammars) -> None:
    rng = random.Random(0)
    matchers = GrammarMatchers(len(VOCAB), 8, torch.device("cpu"))
    references = [xgr.GrammarMatcher(g) for g in grammars]
    outputs: list[list[int]] = [[] for _ in grammars]
    for _ in range(12):
        rows = [
            ConstrainedRow(row, logits, f"r{i}", grammars[i], outputs[i], len(outputs[i]), [], None)
            for i, (row, logits) in enumerate(zip(ROWS, LOGITS_ROWS))
        ]
        matchers.start_fill(rows)
        bitmask = matchers.bitmask(rows, NUM_LOGITS_ROWS)
        assert bitmask.rows.tolist() == LOGITS_ROWS
        # sampled at every logits row; sampling row 2 took one of its drafts
        sampled = torch.full((NUM_LOGITS_ROWS,), EOS, dtype=torch.int64)
        num_accepted = torch.tensor([0, 0, 1, 0, 0, 0])
        for i, (logits, reference) in enumerate(zip(LOGITS_ROWS, references)):
            assert torch.equal(bitmask.words[i], reference_mask(reference))
            if not reference.is_terminated():
                sampled[logits] = rng.choice(allowed_ids(bitmask.words[i]))
                assert reference.accept_token(int(sampled[logits]))
            outputs[i].append(int(sampled[logits]))
        matchers.record_sampled(rows, sampled, num_accepted, None)
    assert any(r.is_terminated() for r in references)  # masks of finished grammars allow all


def test_fill_waits_for_the_step_before_on_its_own_thread(grammars) -> None:
    matchers = GrammarMatchers(len(VOCAB), 8, torch.device("cpu"))
    rows = [ConstrainedRow(0, 0, "r", grammars[4], [], 0, [], None)]  # root ::= "a"
    matchers.start_fill(rows)
    assert allowed_ids(matchers.bitmask(rows, 1).words[0]) == [VOCAB.index("a")]
    step = HeldStep()
    matchers.record_sampled(rows, torch.tensor([VOCAB.index("a")]), None, step)
    after = [ConstrainedRow(0, 0, "r", grammars[4], [VOCAB.index("a")], 1, [], None)]
    matchers.start_fill(after)  # returns while the step before still runs
    step.ran.set()
    assert allowed_ids(matchers.bitmask(after, 1).words[0]) == [EOS]
    assert step.waited_on.startswith("grammar-fill")
