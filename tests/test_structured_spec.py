"""Structured outputs with n-gram speculation on a tiny random Llama, async scheduling on: the
prompts hold answers the grammar allows, so drafts come from them; greedy gives the token ids of
greedy without speculation under the same constraint, drafts are proposed and accepted for
constrained requests, and sampled outputs always satisfy their grammar."""

import json
import re

import pytest
from test_structured_outputs import COLORS, assert_colors

from asyncllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
ANSWER = json.dumps({"color": "red", "ok": True, "tags": ["a", "b"]}, separators=(",", ": "))
COLORS_REGEX = r"(red|green|blue)( (red|green|blue)){7}"
# the random model repeats " blue" (its tokenizations of the other words do not recur)
CHOICES = ["blue blue blue blue blue blue", "red red red red red red", "green"]
CONSTRAINTS = {
    "json": ({"json": COLORS}, f"Answer: {ANSWER} Again: {ANSWER} Once more: "),
    "regex": ({"regex": COLORS_REGEX}, "red green blue red green blue red green blue red "),
    "choice": ({"choice": CHOICES}, f"Say one of: {', '.join(CHOICES)}. I say: "),
}


def holds(kind: str, text: str) -> None:
    if kind == "json":
        assert_colors(text)
    elif kind == "regex":
        assert re.fullmatch(COLORS_REGEX, text), text
    else:
        assert text in CHOICES


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    kwargs = dict(model=str(tiny_model_dir), max_model_len=512, async_scheduling=True)
    return LLM(**kwargs), LLM(**kwargs, speculative_config=NGRAM)


def generate(llm: LLM, prompt: str, params: SamplingParams) -> list:
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    return output.outputs


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_greedy_gives_the_tokens_of_greedy_without_speculation(engines, kind) -> None:
    plain, spec = engines
    constraint, prompt = CONSTRAINTS[kind]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=constraint)
    stats = spec.core_client.core.spec_decoding_stats
    before = stats.snapshot()
    (expected,) = generate(plain, prompt, params)
    (got,) = generate(spec, prompt, params)
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == "stop"
    holds(kind, got.text)
    # the feature is on: the constrained request's drafts were verified and some taken
    assert stats.num_draft_tokens > before.num_draft_tokens
    assert stats.num_accepted_tokens > before.num_accepted_tokens


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_sampled_outputs_hold_with_speculation(engines, kind) -> None:
    """Seeded, each draft position draws as its token would without speculation (README):
    the samples are those of the engine without it."""
    plain, spec = engines
    constraint, prompt = CONSTRAINTS[kind]
    params = SamplingParams(
        n=4, temperature=1.0, seed=11, max_tokens=60, structured_outputs=constraint
    )
    got = generate(spec, prompt, params)
    for completion in got:
        assert completion.finish_reason == "stop"
        holds(kind, completion.text)
    assert [c.token_ids for c in got] == [c.token_ids for c in generate(plain, prompt, params)]


def test_draft_model_drafts_are_cut_and_verified(tiny_model_dir, engines) -> None:
    """Drafts from a worker's proposer (the model drafting for itself, unconstrained) go
    through the same cut: greedy keeps the tokens of greedy without speculation."""
    plain, _ = engines
    speculative = {
        "method": "draft_model",
        "model": str(tiny_model_dir),
        "num_speculative_tokens": 3,
    }
    spec = LLM(
        model=str(tiny_model_dir),
        max_model_len=512,
        async_scheduling=True,
        speculative_config=speculative,
    )
    constraint, prompt = CONSTRAINTS["regex"]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=constraint)
    (expected,) = generate(plain, prompt, params)
    (got,) = generate(spec, prompt, params)
    assert got.token_ids == expected.token_ids
    holds("regex", got.text)
    stats = spec.core_client.core.spec_decoding_stats
    assert stats.num_accepted_tokens > 0
