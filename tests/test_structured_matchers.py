"""The worker's grammar matchers on a small raw vocabulary: the batched fill on its own thread
gives, row for row, the mask each request's own matcher fills one at a time, and it waits for
the step before without holding up the launch."""

import json
import random
import threading
import time

import pytest
import torch
import xgrammar as xgr

from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.structured_output.compiler import GrammarCompiler
from asyncllm.structured_output.grammar_process import Adopt, Step, _HeldGrammars
from asyncllm.structured_output.masks import allow_all
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


def test_allow_all_writes_exactly_the_listed_runs_of_rows() -> None:
    buffer = torch.zeros(12, 3, dtype=torch.int32)
    allow_all(buffer, [0, 1, 4, 6, 9], [1, 3, 2, 1, 2])  # runs 0-3, 4-5 and 6 adjacent; 9-10
    allowed = [r for r in range(12) if bool((buffer[r] == -1).all())]
    assert allowed == [0, 1, 2, 3, 4, 5, 6, 9, 10]
    assert int(buffer[[7, 8, 11]].abs().sum()) == 0


def ready_after(held: _HeldGrammars, step: Step, steps: int = 5) -> list[str]:
    """The ids reported ready by `step` and the empty steps after it, once every request
    held has compiled."""
    ready = held.step(step)
    deadline = time.monotonic() + 10
    while any(h.state is None for h in held._held.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
        ready += held.step(Step())
    for _ in range(steps):
        ready += held.step(Step())
    return ready


def test_the_grammar_process_starts_each_adopted_request_once() -> None:
    """Its requests compile in a pool; each is reported ready in one step only, again when it is
    adopted again (from the outputs it is sent then), and a forgotten one is gone."""
    info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS])
    compiler = GrammarCompiler(lambda: info)
    held = _HeldGrammars(xgr.allocate_token_bitmask(4, len(VOCAB)), compiler, 1)
    constraint = StructuredOutputsParams(regex="(ab|1)+2")
    adopt = [Adopt(name, constraint, None, [], []) for name in ("a", "b")]
    assert sorted(ready_after(held, Step(adopt=adopt))) == ["a", "b"]
    again = Step(forget=["b"], adopt=[Adopt("a", constraint, None, [], [5])])
    assert ready_after(held, again) == ["a"]
    assert list(held._held) == ["a"] and held._held["a"].state.num_accepted == 1
    held.step(Step(accepts=[("a", [9])], rows=[("a", 1, ())]))
    # after "ab" "1": "a" (of "ab"), "ab", "1" or "2"
    assert allowed_ids(held._masks[1]) == [3, 5, 9, 10]
    compiler.shutdown()
