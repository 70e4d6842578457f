"""Structured outputs with a reasoning parser: the grammar holds from the end of the reasoning on.
On a tiny random Llama, a token its greedy output takes plays the end tag: the tokens up to it
are the unconstrained ones, the rest parse; through the server (a tokenizer with <think> and
</think> tokens, the end tag drawn now and then by a logit bias), the content parses, streamed
and not."""

import json

import openai
import pytest
import torch
import transformers
from test_server_support import ServerProcess, tiny_server_args
from test_structured_outputs import COLORS, assert_colors

from asyncllm import LLM, SamplingParams
from asyncllm.sampling_params import ReasoningMarkers, StructuredOutputsParams

PROMPT = [1, 9000, 42, 7]  # greedy: 7 seven times, then 11658


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), max_model_len=512)


@pytest.fixture(scope="module")
def free_tokens(llm) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    return list(output.outputs[0].token_ids)


def end_at(tokens: list[int]) -> int:
    """The first position from 2 on whose token did not come before: it ends the reasoning."""
    return next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k])


def constrained(llm, markers: ReasoningMarkers, prompt: list[int] = PROMPT) -> list[int]:
    structured = StructuredOutputsParams(json=COLORS, reasoning=markers)
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=structured)
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop"
    return list(output.outputs[0].token_ids)


def decode(tiny_model_dir, tokens: list[int]) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    return tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("opened_by_output", [False, True])
def test_reasoning_is_free_and_the_answer_after_it_parses(
    llm, tiny_model_dir, free_tokens, opened_by_output
) -> None:
    k = end_at(free_tokens)
    # Qwen3's way: the output opens the reasoning with its start tag, here the first token
    start = (free_tokens[0],) if opened_by_output else (1,)
    tokens = constrained(llm, ReasoningMarkers(start, (free_tokens[k],), opened_by_output))
    assert tokens[: k + 1] == free_tokens[: k + 1]
    assert_colors(decode(tiny_model_dir, tokens[k + 1 :]))


def test_an_output_that_does_not_open_the_reasoning_is_all_answer(
    llm, tiny_model_dir, free_tokens
) -> None:
    unused = next(t for t in range(1000, 2000) if t not in free_tokens)
    tokens = constrained(llm, ReasoningMarkers((unused,), (free_tokens[2],), True))
    assert_colors(decode(tiny_model_dir, tokens))


def test_a_prompt_that_closed_the_reasoning_asks_for_the_answer_at_once(
    llm, tiny_model_dir, free_tokens
) -> None:
    markers = ReasoningMarkers((7,), (free_tokens[end_at(free_tokens)],), False)
    prompt = [*PROMPT, 7, 9, *markers.end]  # as Qwen3's template does with thinking off
    assert_colors(decode(tiny_model_dir, constrained(llm, markers, prompt)))


@pytest.fixture(scope="module")
def thinking_model_dir(default_model_dir, tmp_path_factory):
    """A random 2-layer Llama whose tokenizer has <think> and </think> as tokens of their own
    (not special ones: their text stays in the output, for the parser)."""
    path = tmp_path_factory.mktemp("thinking-llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def client(thinking_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = tiny_server_args(thinking_model_dir, "--served-model-name", "m")
    process = ServerProcess(log, *args, "--reasoning-parser", "deepseek_r1")
    server = process.start()
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    process.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_server_reasoning_then_content_that_parses(client, thinking_model_dir, stream) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(thinking_model_dir)
    (end,) = tokenizer.encode("</think>", add_special_tokens=False)
    kwargs = dict(
        model="m",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=120,
        seed=3,
        logit_bias={str(end): 6},  # the reasoning ends after a few tokens
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "colors", "schema": COLORS},
        },
    )
    if stream:
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = getattr(message, "reasoning_content", None), message.content
    assert reasoning  # the random model thought before it answered
    assert "</think>" not in content
    assert_colors(content)
    json.loads(content)
