"""Structured outputs through the engine on a tiny random Llama: whatever the random model
prefers, every output is accepted by its grammar, and finished ones are complete."""

import json
import os
import re
import signal
import time

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ValidationError
from asyncllm.sample.grammar_mask import TokenBitmask, apply_token_bitmask
from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.structured_output import matchers
from asyncllm.structured_output.compiler import tokenizer_info
from asyncllm.structured_output.matchers import GrammarMatchers
from asyncllm.worker.model_runner import ModelRunner

COLORS = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), max_model_len=512, max_num_batched_tokens=64)


def generate(llm, constraint: dict, n: int = 1, **kwargs) -> list[str]:
    structured = StructuredOutputsParams(**constraint)
    params = SamplingParams(n=n, max_tokens=60, seed=0, structured_outputs=structured, **kwargs)
    (output,) = llm.generate("Answer:", params, use_tqdm=False)
    assert all(o.finish_reason == "stop" for o in output.outputs), output.outputs
    return [o.text for o in output.outputs]


def assert_colors(text: str) -> None:
    value = json.loads(text)
    assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
    assert set(value["tags"]) <= {"a", "b"} and len(value["tags"]) <= 2
    assert set(value) == {"color", "ok", "tags"}


def test_json_schema_holds_for_every_sample(llm) -> None:
    for text in generate(llm, {"json": COLORS}, n=4, temperature=1.0):
        assert_colors(text)


def test_greedy_json_schema_holds(llm) -> None:
    assert_colors(generate(llm, {"json": json.dumps(COLORS)}, temperature=0)[0])


def test_choice_gives_one_of_them(llm) -> None:
    choices = ['say "yes"', "no\nway", "maybe"]
    texts = generate(llm, {"choice": choices}, n=6, temperature=1.5)
    assert set(texts) <= set(choices)


def test_regex_matches_whole_output(llm) -> None:
    for text in generate(llm, {"regex": r"[0-9]{3}-[a-c]{2}"}, n=3, temperature=1.0):
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", text)


def test_ebnf_grammar(llm) -> None:
    grammar = 'root ::= "(" item (", " item)? ")"\nitem ::= "x" | "y"'
    for text in generate(llm, {"grammar": grammar}, n=3, temperature=1.0):
        assert re.fullmatch(r"\([xy](, [xy])?\)", text)


def test_json_object_is_an_object(llm) -> None:
    params = SamplingParams(
        max_tokens=200, seed=1, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    (output,) = llm.generate("JSON:", params, use_tqdm=False)
    completion = output.outputs[0]
    if completion.finish_reason == "stop":
        assert isinstance(json.loads(completion.text), dict)
    else:  # the random model may open strings it never closes: the text starts an object
        assert completion.text.startswith("{")


def test_constrained_and_free_requests_share_a_batch(llm) -> None:
    constrained = SamplingParams(
        max_tokens=60, temperature=1.0, seed=3, structured_outputs={"json": COLORS}
    )
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outputs = llm.generate(
        ["one", "two", "three"], [constrained, free, constrained], use_tqdm=False
    )
    assert_colors(outputs[0].outputs[0].text)
    assert_colors(outputs[2].outputs[0].text)
    (alone,) = llm.generate("two", free, use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize(
    "extra", [{"async_scheduling": True}, {"num_kv_blocks": 20, "block_size": 4}]
)
def test_async_scheduling_and_preemption_keep_the_grammar(tiny_model_dir, extra) -> None:
    engine = LLM(model=str(tiny_model_dir), max_model_len=512, **extra)
    params = SamplingParams(
        max_tokens=60, temperature=1.0, seed=5, structured_outputs={"json": COLORS}
    )
    prompts = [f"prompt {i} " * (2 + i) for i in range(5)]
    for output in engine.generate(prompts, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        assert_colors(output.outputs[0].text)
    if "num_kv_blocks" in extra:
        assert engine.core_client.core.scheduler.num_preemptions > 0


def test_a_constrained_launch_returns_before_its_masks_are_filled(
    tiny_model_dir, monkeypatch
) -> None:
    """Under async scheduling the core's thread does not wait for the grammars' masks inside a
    step's launch (they need the step before's ids): the step's wait() samples once they are
    filled, and the grammar still holds."""
    engine = LLM(model=str(tiny_model_dir), max_model_len=512, async_scheduling=True)
    fills = {"started": 0, "finished": 0}
    launches_before_their_fill_ended = []
    real_fill, real_execute = GrammarMatchers._fill_host, ModelRunner.execute_model

    def slow_fill(matchers, rows):
        time.sleep(0.05)
        real_fill(matchers, rows)
        fills["finished"] += 1

    def execute(runner, scheduler_output):
        started = fills["started"] = fills["started"] + 1
        launched = real_execute(runner, scheduler_output)
        launches_before_their_fill_ended.append(fills["finished"] < started)
        return launched

    monkeypatch.setattr(GrammarMatchers, "_fill_host", slow_fill)
    monkeypatch.setattr(ModelRunner, "execute_model", execute)
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": COLORS})
    (output,) = engine.generate("Answer:", params, use_tqdm=False)
    assert_colors(output.outputs[0].text)
    assert sum(launches_before_their_fill_ended) >= len(output.outputs[0].token_ids) - 1


def test_grammar_holds_beside_requests_that_speculate(tiny_model_dir) -> None:
    engine = LLM(
        model=str(tiny_model_dir),
        max_model_len=512,
        async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    constrained = SamplingParams(
        n=2, max_tokens=60, temperature=1.0, seed=7, structured_outputs={"json": COLORS}
    )
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    copying = "red green blue red green blue red green blue red green"
    outputs = engine.generate([copying, copying], [constrained, free], use_tqdm=False)
    for completion in outputs[0].outputs:
        assert_colors(completion.text)
    assert engine.core_client.core.spec_decoding_stats.num_draft_tokens > 0


def test_grammar_vocabulary_is_the_tokenizers_not_the_logits(padded_tiny_model_dir) -> None:
    info = tokenizer_info(padded_tiny_model_dir, 2 * 49152, [2])
    # xgrammar would count each padding id as a special token, scanned at every accept
    assert info.vocab_size == 49152 and info.special_token_ids == []


def test_grammar_holds_where_the_logits_pad_the_vocabulary(padded_tiny_model_dir) -> None:
    engine = LLM(model=str(padded_tiny_model_dir), max_model_len=512)
    params = SamplingParams(
        n=4, max_tokens=60, temperature=1.5, seed=11, structured_outputs={"json": COLORS}
    )
    (output,) = engine.generate("Answer:", params, use_tqdm=False)
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        assert_colors(completion.text)
        assert max(completion.token_ids) < 49152  # half the logits are padding


@pytest.mark.parametrize(
    ("constraint", "param"),
    [
        ({"json": {"type": "bogus"}}, "structured_outputs.json"),
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_invalid_constraint_is_refused_naming_the_field(llm, constraint, param) -> None:
    params = SamplingParams(structured_outputs=constraint)
    with pytest.raises(ValidationError) as raised:
        llm.generate("x", params, use_tqdm=False)
    assert raised.value.param == param


def test_structured_outputs_needs_exactly_one_constraint() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValidationError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValidationError) as raised:
        StructuredOutputsParams(choice=[])
    assert raised.value.param == "structured_outputs.choice"


def test_bitmask_forbids_exactly_the_cleared_bits() -> None:
    torch.manual_seed(0)
    vocab, rows = 70, torch.tensor([2, 0])
    logits = torch.randn(3, vocab)
    words = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for token in range(vocab):
            if not (int(words[i, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    whole = logits[[0, 2]].clone()
    apply_token_bitmask(logits, TokenBitmask(rows, words))
    assert torch.equal(logits, expected)
    apply_token_bitmask(whole, TokenBitmask(None, words.flip(0)))  # every row, in order
    assert torch.equal(whole, expected[[0, 2]])


def test_bitmask_forbids_the_logits_past_its_words() -> None:
    logits = torch.zeros(2, 100)
    words = torch.full((1, 2), -1, dtype=torch.int32)  # tokens 0 to 63 allowed
    apply_token_bitmask(logits, TokenBitmask(torch.tensor([1]), words))
    assert torch.equal(logits[0], torch.zeros(100))
    assert torch.equal(logits[1, :64], torch.zeros(64))
    assert torch.equal(logits[1, 64:], torch.full((36,), float("-inf")))


PROCESS_PARAMS = SamplingParams(
    n=3, max_tokens=80, temperature=1.0, seed=11, structured_outputs={"json": COLORS}
)


def engine_with_grammar_process(model_dir, monkeypatch, **kwargs) -> LLM:
    """An engine whose grammar process has started (a first constrained request starts it)."""
    monkeypatch.setattr(matchers, "wants_grammar_process", lambda: True)
    engine = LLM(model=str(model_dir), max_model_len=512, async_scheduling=True, **kwargs)
    engine.generate("warm up", PROCESS_PARAMS, use_tqdm=False)
    process = engine.core_client.core.executor.model_runner.grammar_matchers.process
    deadline = time.monotonic() + 60
    while not process.started():
        assert time.monotonic() < deadline, "the grammar process did not start"
        time.sleep(0.1)
    return engine


@pytest.mark.parametrize("speculation", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_grammar_process_holds_the_grammars(tiny_model_dir, monkeypatch, speculation) -> None:
    """Where the cores allow it, a process of its own takes the requests over once it has
    compiled their constraints: it takes their tokens and fills their masks (the rows of drafts
    too), and every output still follows its schema."""
    engine = engine_with_grammar_process(
        tiny_model_dir, monkeypatch, speculative_config=speculation
    )
    params = PROCESS_PARAMS
    remote_rows = []
    real_send = matchers.GrammarMatchers._send_step

    def send_step(self, remote):
        remote_rows.append(len(remote))
        return real_send(self, remote)

    monkeypatch.setattr(matchers.GrammarMatchers, "_send_step", send_step)
    copying = "red green blue red green blue red green blue red green"
    for output in engine.generate([copying, "Answer:"], params, use_tqdm=False):
        for completion in output.outputs:
            assert completion.finish_reason == "stop"
            assert_colors(completion.text)
    assert sum(remote_rows) > 0
    engine.core_client.core.executor.model_runner.grammar_matchers.close()


def test_a_dead_grammar_process_fails_its_step_and_the_grammars_come_back(
    tiny_model_dir, monkeypatch
) -> None:
    """The grammar process dies while it fills requests' rows: those requests fail with the
    step (their tokens in flight cannot be followed here), and the next requests are matched
    in the worker, their schemas held."""
    engine = engine_with_grammar_process(tiny_model_dir, monkeypatch)
    grammar_matchers = engine.core_client.core.executor.model_runner.grammar_matchers
    real_receive = matchers.GrammarMatchers._receive_step

    def receive_step(self, remote, num_masked):
        if remote and self.process is not None:
            os.kill(self.process.pid, signal.SIGKILL)
        return real_receive(self, remote, num_masked)

    monkeypatch.setattr(matchers.GrammarMatchers, "_receive_step", receive_step)
    (failed,) = engine.generate("Answer:", PROCESS_PARAMS, use_tqdm=False)
    assert failed.error is not None and "grammar process" in failed.error
    assert grammar_matchers.process is None
    (after,) = engine.generate("Answer:", PROCESS_PARAMS, use_tqdm=False)
    for completion in after.outputs:
        assert completion.finish_reason == "stop"
        assert_colors(completion.text)
