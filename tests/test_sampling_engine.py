"""Sampling features end to end on the tiny random Llama: n > 1, best_of, logprobs,
prompt_logprobs, bad_words, min_tokens, and validation that names the field."""

import asyncio

import pytest
import torch
import transformers

from asyncllm import LLM, AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), max_model_len=512, max_logprobs=8)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def generate_one(llm, prompt, **kwargs):
    return llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


def test_n_returns_n_indexed_completions(llm) -> None:
    output = generate_one(
        llm, "Tell me a story", n=3, temperature=1.0, max_tokens=6, ignore_eos=True
    )
    assert output.finished and [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    assert output.num_generated_tokens == 18
    assert not llm.core_client.core.scheduler.has_unfinished_requests()
    assert llm.core_client.core.kv_cache_manager.usage == 0


def test_parallel_samples_share_the_prompt_blocks(llm) -> None:
    prompt = {"prompt_token_ids": list(range(100, 150))}  # 3 full blocks of 16
    manager = llm.core_client.core.kv_cache_manager
    hits_before = manager.prefix_cache_hits
    generate_one(llm, prompt, n=4, max_tokens=3, ignore_eos=True)
    assert manager.prefix_cache_hits - hits_before == 3 * 48


def test_seeded_n_is_reproducible_and_each_sample_differs(llm) -> None:
    params = dict(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    first = [c.token_ids for c in generate_one(llm, "Seeds", **params).outputs]
    second = [c.token_ids for c in generate_one(llm, "Seeds", **params).outputs]
    assert first == second and len({tuple(t) for t in first}) == 3
    single = generate_one(llm, "Seeds", seed=12, temperature=1.0, max_tokens=8, ignore_eos=True)
    assert single.outputs[0].token_ids == first[1]  # sample i runs with seed + i


def test_best_of_returns_the_n_most_likely_samples(llm) -> None:
    params = dict(n=2, best_of=5, seed=3, temperature=1.0, max_tokens=5, ignore_eos=True)
    output = generate_one(llm, "Pick", logprobs=0, **params)
    scores = [c.cumulative_logprob for c in output.outputs]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    for completion in output.outputs:
        chosen = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert completion.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)
    everyone = generate_one(llm, "Pick", logprobs=0, **{**params, "n": 5, "best_of": None})
    assert scores == sorted(c.cumulative_logprob for c in everyone.outputs)[::-1][:2]
    plain = generate_one(llm, "Pick", **params)
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in plain.outputs)


def test_logprobs_match_the_model_log_softmax(llm, hf_model) -> None:
    prompt = [5, 60, 700, 8000]
    output = generate_one(
        llm, {"prompt_token_ids": prompt}, temperature=0, max_tokens=3, logprobs=5
    )
    completion = output.outputs[0]
    reference = hf_logprobs(hf_model, prompt + completion.token_ids)
    for step, (token_id, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt) - 1 + step]
        assert logprobs[token_id].rank == 1  # greedy: the chosen token is the top one
        assert list(logprobs) == row.topk(5).indices.tolist()
        for candidate, logprob in logprobs.items():
            assert logprob.logprob == pytest.approx(row[candidate].item(), abs=1e-4)
            assert logprob.decoded_token is not None


TOLERANCE = 1e-4


def test_prompt_logprobs_match_the_model_log_softmax(tiny_model_dir, hf_model) -> None:
    # a small batch budget makes the prompt arrive in chunks
    llm = LLM(
        model=str(tiny_model_dir), max_model_len=512, max_num_batched_tokens=16, max_num_seqs=4
    )
    prompt = list(range(300, 340))
    output = generate_one(llm, {"prompt_token_ids": prompt}, prompt_logprobs=3, max_tokens=2)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    reference = hf_logprobs(hf_model, prompt)
    for position, logprobs in enumerate(output.prompt_logprobs[1:], start=1):
        token_id = prompt[position]
        row = reference[position - 1]
        assert list(logprobs) == list(dict.fromkeys([token_id, *row.topk(3).indices.tolist()]))
        # the rank HF's values give, up to the tokens within the logprobs' tolerance of the
        # chosen one (49,152 random logits: near-ties an fp32 rounding apart are common)
        above, near = row > row[token_id] + TOLERANCE, (row - row[token_id]).abs() <= TOLERANCE
        assert 0 <= logprobs[token_id].rank - int(above.sum()) - 1 <= int(near.sum())
        for candidate, logprob in logprobs.items():
            assert logprob.logprob == pytest.approx(row[candidate].item(), abs=TOLERANCE)


def test_bad_words_are_never_generated(llm) -> None:
    free = generate_one(llm, "Once upon a time", temperature=0, max_tokens=1, ignore_eos=True)
    first = free.outputs[0].token_ids[0]
    word = llm.get_tokenizer().decode([first])
    banned = generate_one(llm, "Once upon a time", temperature=0, max_tokens=1, bad_words=[word])
    assert banned.outputs[0].token_ids[0] != first


def test_min_tokens_holds_back_eos(llm) -> None:
    prompt = {"prompt_token_ids": [2] * 4}
    first = (
        generate_one(llm, prompt, temperature=0, max_tokens=1, ignore_eos=True)
        .outputs[0]
        .token_ids[0]
    )
    config = llm.input_processor.model_config
    saved, config.eos_token_ids = config.eos_token_ids, frozenset({first})
    try:
        held = generate_one(llm, prompt, temperature=0, max_tokens=10, min_tokens=4)
    finally:
        config.eos_token_ids = saved
    token_ids = held.outputs[0].token_ids
    assert first not in token_ids[:4] and len(token_ids) >= 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"min_p": 1.5}, "min_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logit_bias": {1: 200.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logprobs": 9}, "logprobs"),
        ({"prompt_logprobs": 9}, "prompt_logprobs"),
        ({"logit_bias": {49152: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ],
)
def test_values_beyond_the_model_name_the_field(llm, kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate("hi", SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.core_client.core.scheduler.has_unfinished_requests()


async def test_async_n_streams_and_aborting_the_parent_aborts_every_sample(tiny_model_dir) -> None:
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=512))
    try:
        params = SamplingParams(
            n=2, max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        pieces = [out async for out in engine.generate("count", params, "p")]
        assert pieces[-1].finished
        tokens = {0: [], 1: []}
        for piece in pieces:
            for completion in piece.outputs:
                tokens[completion.index] += completion.token_ids
        assert [len(t) for t in tokens.values()] == [5, 5]
        cumulative = SamplingParams(n=2, max_tokens=5, ignore_eos=True)
        final = [out async for out in engine.generate("count", cumulative, "q")][-1]
        assert [len(c.token_ids) for c in final.outputs] == [5, 5]

        long = SamplingParams(n=3, max_tokens=400, ignore_eos=True)
        stream = engine.generate("go on", long, "victim")
        await anext(stream)
        await anext(stream)
        core = engine.core_client.core
        assert core.scheduler.num_running + core.scheduler.num_waiting == 3
        engine.abort("victim")
        await stream.aclose()
        for _ in range(500):
            if not core.has_work():
                break
            await asyncio.sleep(0.01)
        assert not core.has_work()
        assert core.kv_cache_manager.usage == 0
    finally:
        await engine.shutdown()
