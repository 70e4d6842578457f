"""Drafts of constrained requests on a small raw vocabulary: the engine core cuts them at the
first token the grammar forbids (and after the grammar's stop token), leaving the grammar's
state as it was; the worker masks each draft position with the state after the drafts before
it, and after the verify step its matcher takes exactly the accepted drafts and the token
after them."""

import json

import pytest
import torch
import xgrammar as xgr
from test_structured_matchers import VOCAB, allowed_ids, reference_mask

from asyncllm.request import Request
from asyncllm.sampling_params import ReasoningMarkers, SamplingParams, StructuredOutputsParams
from asyncllm.structured_output.draft_check import DraftChecker
from asyncllm.structured_output.matchers import ConstrainedRow, GrammarMatchers
from asyncllm.structured_output.state import GrammarState

EOS = VOCAB.index("</s>")
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
START, END = VOCAB.index("["), VOCAB.index("]")  # stand for <think> and </think>


def ids(*tokens: str) -> list[int]:
    return [VOCAB.index(t) for t in tokens]


ANSWER = ids("{", '"', "a", '"', ":", " ", "true", "}")  # xgrammar's separator is ": "


@pytest.fixture(scope="module")
def grammar() -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)


def request(grammar, outputs: list[int], markers: ReasoningMarkers | None = None) -> Request:
    structured = StructuredOutputsParams(json=SCHEMA, reasoning=markers)
    params = SamplingParams(structured_outputs=structured)
    made = Request("r", [0], params, grammar=grammar)
    for token_id in outputs:
        made.append_output_token(token_id)
    return made


@pytest.mark.parametrize(
    ("outputs", "drafts", "kept"),
    [
        ([], ANSWER, 8),
        ([], ids("{", '"', "a", '"', ",", ":", "true"), 4),  # "," where ":" must come
        (ids("{", '"'), ids("b", '"'), 0),  # the only key is "a"
        (ANSWER[:6], ids("false", "}", "</s>", "a"), 3),  # nothing after the stop token
    ],
)
def test_drafts_are_cut_at_the_first_the_grammar_forbids(grammar, outputs, drafts, kept) -> None:
    checker = DraftChecker()
    constrained = request(grammar, outputs)
    assert checker.valid_prefix(constrained, drafts) == drafts[:kept]
    # the check left the state after the outputs: the same drafts are cut the same again
    assert checker.valid_prefix(constrained, drafts) == drafts[:kept]


def test_the_check_follows_the_outputs(grammar) -> None:
    checker = DraftChecker()
    constrained = request(grammar, ANSWER[:1])
    assert checker.valid_prefix(constrained, ids('"', "a", ":")) == ids('"', "a")
    for token_id in ids('"', "a", '"'):  # the verify step took two drafts and a token after
        constrained.append_output_token(token_id)
    rest = ids(":", " ", "false", "}", "</s>")
    assert checker.valid_prefix(constrained, rest) == rest
    assert checker.valid_prefix(constrained, ids("}")) == []


def test_drafts_inside_the_reasoning_are_free(grammar) -> None:
    markers = ReasoningMarkers((START,), (END,), opened_by_output=True)
    constrained = request(grammar, [], markers)
    drafts = ids("[", "b", ",", "]", "{", '"', "b")  # thinks, then answers with a bad key
    assert DraftChecker().valid_prefix(constrained, drafts) == drafts[:6]


def test_drafts_move_the_state_on_until_rolled_back(grammar) -> None:
    state = GrammarState(grammar, None, [])
    state.accept_all(ANSWER[:2])
    reference = xgr.GrammarMatcher(grammar)
    for token_id in ANSWER[:2]:
        assert reference.accept_token(token_id)
    for token_id in ANSWER[2:6]:
        assert state.take_draft(token_id) and reference.accept_token(token_id)
        assert allowed_ids(reference_mask(state.matcher)) == allowed_ids(reference_mask(reference))
    assert not state.take_draft(VOCAB.index("}"))  # a value must come
    state.roll_back_drafts()
    assert state.num_accepted == 2
    assert allowed_ids(reference_mask(state.matcher)) == ids("a")


def test_each_draft_position_is_masked_with_its_own_state(grammar) -> None:
    """Request r0 verifies 3 drafts (logits rows 0-3) and r1 samples alone (row 5), beside a
    free row (4); r0's masks are those of a reference matcher after each prefix of its drafts,
    and after the step the matchers take exactly the accepted draft and the token after it."""
    matchers = GrammarMatchers(len(VOCAB), 8, torch.device("cpu"))
    drafts = ids(":", " ", "true")
    rows = [
        ConstrainedRow(0, 0, "r0", grammar, ANSWER[:4], 4, [], None, drafts),
        ConstrainedRow(2, 5, "r1", grammar, [], 0, [], None),
    ]
    matchers.start_fill(rows)
    bitmask = matchers.bitmask(rows, 6)
    assert bitmask.rows.tolist() == [0, 1, 2, 3, 5]
    reference = xgr.GrammarMatcher(grammar)
    for token_id in ANSWER[:4]:
        assert reference.accept_token(token_id)
    for j in range(4):
        assert allowed_ids(bitmask.words[j]) == allowed_ids(reference_mask(reference))
        if j < 3:
            assert reference.accept_token(drafts[j])
    assert [allowed_ids(bitmask.words[j]) for j in (0, 1, 3)] == [ids(":"), ids(" "), ids("}")]
    assert allowed_ids(bitmask.words[4]) == ids("{")
    # r0 took ":" and " ", then sampled "false" where "true" was drafted
    sampled = torch.tensor(ids(":", " ", "false", "}", "a", "{"))
    matchers.record_sampled(rows, sampled, torch.tensor([2, 0, 0]), None)
    outputs = ANSWER[:4] + ids(":", " ", "false")
    after = [
        ConstrainedRow(0, 0, "r0", grammar, outputs, 7, [], None),
        ConstrainedRow(1, 1, "r1", grammar, ids("{"), 1, [], None),
    ]
    matchers.start_fill(after)
    bitmask = matchers.bitmask(after, 2)
    assert bitmask.rows is None
    assert allowed_ids(bitmask.words[0]) == ids("}")
    assert allowed_ids(bitmask.words[1]) == ids('"')
    assert matchers._tracked["r0"].num_accepted == 7  # moved on, not restarted from the outputs


def test_drafts_of_several_requests_and_a_draft_the_grammar_forbids(grammar) -> None:
    """r0 verifies 2 drafts, r1 one the grammar forbids (the core would have cut it): r1's
    row after it allows every token, as it only follows a rejected draft."""
    matchers = GrammarMatchers(len(VOCAB), 8, torch.device("cpu"))
    rows = [
        ConstrainedRow(0, 0, "r0", grammar, [], 0, [], None, ids("{", '"')),
        ConstrainedRow(1, 3, "r1", grammar, ANSWER[:1], 1, [], None, ids("}")),
    ]
    matchers.start_fill(rows)
    bitmask = matchers.bitmask(rows, 5)
    assert bitmask.rows is None
    masks = [allowed_ids(bitmask.words[j]) for j in range(5)]
    assert masks == [ids("{"), ids('"'), ids("a"), ids('"'), list(range(len(VOCAB)))]
    assert [matchers._tracked[r].num_accepted for r in ("r0", "r1")] == [0, 1]
