"""Speculative decoding end to end: the same tokens as without it."""

import pytest
import torch
import transformers

from asyncllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
COPYING = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "apple, banana, cherry, apple, banana, cherry, apple,",
]


def generate(llm: LLM, prompts: list[str], params: SamplingParams) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


SMALL_PROMPTS = [{"prompt_token_ids": [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]}, {"prompt_token_ids": [7]}]


@pytest.fixture(scope="module")
def tiny_pair(small_vocab_dir):
    kwargs = dict(model=str(small_vocab_dir), max_model_len=256, max_num_batched_tokens=64)
    return LLM(**kwargs), LLM(**kwargs, speculative_config=NGRAM)


def spec_stats(llm: LLM):
    return llm.core_client.core.spec_decoding_stats


def test_ngram_greedy_gives_the_default_models_own_tokens():
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = generate(LLM(max_model_len=256), COPYING, params)
    spec = LLM(max_model_len=256, speculative_config=NGRAM)
    drafted = generate(spec, COPYING, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert spec_stats(spec).num_accepted_tokens > 0


def test_ngram_greedy_matches_with_async_scheduling(small_vocab_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = dict(model=str(small_vocab_dir), max_model_len=256, async_scheduling=True)
    plain = generate(LLM(**kwargs), SMALL_PROMPTS, params)
    spec = LLM(**kwargs, speculative_config=NGRAM)
    got = generate(spec, SMALL_PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert spec_stats(spec).num_accepted_tokens > 0


def test_speculating_with_async_scheduling_launches_the_next_step_before_returning(
    small_vocab_dir,
):
    """A step is not scheduled ahead of the verify step before it, but it is launched as soon
    as that step's output is taken in: the device runs it while the front end takes in the
    outputs."""
    spec = LLM(
        model=str(small_vocab_dir), max_model_len=256, async_scheduling=True,
        speculative_config=NGRAM,
    )  # fmt: skip
    core = spec.core_client.core
    take_step, in_flight = core.step, []

    def step():
        taken = take_step()
        if core.scheduler.has_unfinished_requests():
            in_flight.append(len(core._in_flight))
        return taken

    core.step = step
    generate(spec, SMALL_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert spec_stats(spec).num_drafts > 0
    assert in_flight and all(n >= 1 for n in in_flight)


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.8),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.0, top_p=0.7, min_p=0.05),
        dict(temperature=0.5, logprobs=3, logit_bias={5: 2.0}),
        dict(temperature=1.0, allowed_token_ids=[3, 4, 5, 6, 7, 8]),
    ],
)
def test_seeded_sampling_gives_the_same_tokens(tiny_pair, settings):
    plain, spec = tiny_pair
    params = SamplingParams(max_tokens=48, ignore_eos=True, seed=7, **settings)
    before = spec_stats(spec).num_accepted_tokens
    want = generate(plain, SMALL_PROMPTS, params)
    got = generate(spec, SMALL_PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if "logprobs" in settings:
        # a verify step computes several positions at once: the floats may differ in the last bits
        for a, b in zip(got, want):
            assert [{t: (p.rank, p.logprob) for t, p in d.items()} for d in a.logprobs] == [
                {t: (p.rank, pytest.approx(p.logprob, abs=1e-4)) for t, p in d.items()}
                for d in b.logprobs
            ]
    assert spec_stats(spec).num_accepted_tokens > before


def test_penalised_requests_decode_without_drafts(tiny_pair):
    plain, spec = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True)
    before = spec_stats(spec).num_drafts
    want = generate(plain, SMALL_PROMPTS, params)
    got = generate(spec, SMALL_PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec_stats(spec).num_drafts == before


def test_draft_model_greedy_gives_the_default_models_own_tokens(default_model_dir):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kwargs = dict(max_model_len=256, kv_cache_memory=1 << 26)
    plain = generate(LLM(**kwargs), COPYING, params)
    config = {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 3}
    spec = LLM(**kwargs, speculative_config=config)
    drafted = generate(spec, COPYING, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    stats = spec_stats(spec)
    # the draft is the target itself: its drafts are the target's greedy tokens
    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens


@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=0.9, top_k=8, seed=5)])
def test_draft_model_of_another_model_gives_the_same_tokens(small_vocab_dir, tmp_path, settings):
    """A random draft model of the same vocabulary: few drafts accepted, the output exact."""
    config = transformers.AutoConfig.from_pretrained(small_vocab_dir)
    config.num_hidden_layers = 1
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    kwargs = dict(model=str(small_vocab_dir), max_model_len=256, kv_cache_memory=1 << 24)
    speculative = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=40, ignore_eos=True, **settings)
    want = generate(LLM(**kwargs), SMALL_PROMPTS, params)
    spec = LLM(**kwargs, speculative_config=speculative)
    got = generate(spec, SMALL_PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec_stats(spec).num_draft_tokens > 0


def test_heads_from_a_missing_folder_are_refused(tiny_model_dir):
    config = {"method": "medusa", "num_speculative_tokens": 2, "model": "heads"}
    with pytest.raises(ValueError, match="'heads' does not exist"):
        LLM(model=str(tiny_model_dir), speculative_config=config)
