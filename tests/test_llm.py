"""The offline LLM API on a tiny random Llama (SmolLM2's tokenizer and chat template)."""

import pytest

from asyncllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), max_num_batched_tokens=64, max_model_len=512)


def kv_usage(llm: LLM) -> float:
    return llm.core_client.core.kv_cache_manager.usage


def test_generate_returns_outputs_in_prompt_order(llm) -> None:
    prompts = ["one", "two two", "three three three"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert all(o.finished and len(o.outputs[0].token_ids) == 5 for o in outputs)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_token_id_prompts_are_accepted(llm) -> None:
    (output,) = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3), use_tqdm=False
    )
    assert output.prompt_token_ids == [5, 6, 7]
    assert len(output.outputs[0].token_ids) == 3


def test_batched_greedy_equals_one_at_a_time(llm) -> None:
    prompts = ["a b c d e f g h i j k l m n o p q r s t u v w x y z" * 3, "hello", "the end of it"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_preemption_gives_identical_outputs(tiny_model_dir) -> None:
    prompts = [f"request number {i} " * (3 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(model=str(tiny_model_dir), max_model_len=512)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(model=str(tiny_model_dir), max_model_len=512, num_kv_blocks=24, block_size=4)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.core_client.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert kv_usage(tight) == 0


def test_long_prefill_token_threshold_spreads_a_prompt_over_steps(llm, tiny_model_dir) -> None:
    """A prompt longer than the threshold is computed a capped chunk a step, beside the decoding
    requests, and the greedy outputs do not change."""
    prompts = ["a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2, "hello"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    capped = LLM(model=str(tiny_model_dir), max_model_len=512, long_prefill_token_threshold=16)
    assert capped.core_client.core.scheduler.config.long_prefill_token_threshold == 16
    outputs = capped.generate(prompts, params, use_tqdm=False)
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert len(outputs[0].prompt_token_ids) > 3 * 16


def test_shared_prefix_is_computed_once(llm) -> None:
    prefix = "You are a helpful assistant. " * 8
    llm.generate(prefix + "First question?", SamplingParams(max_tokens=2), use_tqdm=False)
    hits_before = llm.core_client.core.kv_cache_manager.prefix_cache_hits
    (output,) = llm.generate(prefix + "Second one?", SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.num_cached_tokens >= 32
    assert (
        llm.core_client.core.kv_cache_manager.prefix_cache_hits - hits_before
        == output.num_cached_tokens
    )


def test_stop_string_is_not_emitted(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (free_run,) = llm.generate("Tell me", params, use_tqdm=False)
    text = free_run.outputs[0].text
    stop = text[5:8]
    assert stop.strip(), "the tiny model's text must have a non-blank stop candidate"
    (stopped,) = llm.generate(
        "Tell me", SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False
    )
    completion = stopped.outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert kv_usage(llm) == 0


def test_stop_token_ids_stop_generation(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    (free_run,) = llm.generate("Once upon", params, use_tqdm=False)
    stop_id = free_run.outputs[0].token_ids[3]
    first = free_run.outputs[0].token_ids.index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id])
    (stopped,) = llm.generate("Once upon", params, use_tqdm=False)
    assert stopped.outputs[0].token_ids == free_run.outputs[0].token_ids[: first + 1]
    assert stopped.outputs[0].stop_reason == stop_id


def test_eos_stops_unless_ignored(llm) -> None:
    # a random model rarely emits its eos: declare its first greedy token the eos instead
    eos_prompt = {"prompt_token_ids": [2] * 4}
    params = SamplingParams(temperature=0, max_tokens=8)
    (free_run,) = llm.generate(
        eos_prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    first = free_run.outputs[0].token_ids[0]
    core = llm.core_client.core
    saved = llm.input_processor.model_config.eos_token_ids
    llm.input_processor.model_config.eos_token_ids = frozenset({first})
    try:
        (stopped,) = llm.generate(eos_prompt, params, use_tqdm=False)
        (ignored,) = llm.generate(
            eos_prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
    finally:
        llm.input_processor.model_config.eos_token_ids = saved
    assert stopped.outputs[0].token_ids == [first]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason is None
    assert len(ignored.outputs[0].token_ids) == 8
    assert not core.has_work()


def test_seeded_sampling_is_independent_of_the_batch(llm) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate("Pick a word", seeded, use_tqdm=False)
    mixed = llm.generate(
        ["Something else", "Pick a word", "More"], [other, seeded, other], use_tqdm=False
    )
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_unseeded_sampling_differs_between_runs(llm) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = {
        tuple(llm.generate("Pick a word", params, use_tqdm=False)[0].outputs[0].token_ids)
        for _ in range(3)
    }
    assert len(runs) > 1


def test_chat_applies_the_chat_template(llm) -> None:
    (output,) = llm.chat(
        [{"role": "user", "content": "Hi there"}], SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert output.prompt.startswith("<|im_start|>")
    assert output.prompt.rstrip().endswith("<|im_start|>assistant")
    tokenizer = llm.get_tokenizer()
    assert output.prompt_token_ids == tokenizer.encode(output.prompt, add_special_tokens=False)


def test_progress_bar_reports_every_prompt(llm, capsys) -> None:
    llm.generate(["x", "y", "z"], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "3/3" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ("word " * 600, SamplingParams(), "maximum model length"),
        ({"prompt_token_ids": [10**6]}, SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_prompts_raise_before_reaching_the_engine(llm, prompt, params, field) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.core_client.core.scheduler.has_unfinished_requests()
    assert kv_usage(llm) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="model"):
        LLM(model="/nonexistent/model")


def test_unsupported_architecture_is_a_value_error(tmp_path) -> None:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="architecture"):
        LLM(model=str(tmp_path), load_format="dummy")
