"""Structured outputs with n-gram speculation on a CUDA device (verify graphs, async scheduling
on, the GPU default): greedy, and seeded sampling, give the token ids they give without
speculation under the same constraint. The random Llama's tokenizer has one token a byte, so a
text has one tokenization: the grammar forces the JSON's keys token by token, and drafts copied
from the prompt's answer are accepted there."""

import json
import re

import pytest
import torch
import transformers

from asyncllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 3},
    },
    "required": ["colour", "ok", "tags"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"colour": "blue", "ok": True, "tags": ["alpha"]}, separators=(",", ": "))
REGEX = r"(red|green|blue)( (red|green|blue)){5}"
CONSTRAINTS = {
    "json": ({"json": SCHEMA}, f"{ANSWER}\n{ANSWER}\n"),
    "regex": ({"regex": REGEX}, "red green blue red green blue\n"),
}


@pytest.fixture(scope="module")
def byte_model_dir(tmp_path_factory):
    return save_byte_model(tmp_path_factory.mktemp("structured-spec-gpu"), logits_per_token=1)


@pytest.fixture(scope="module")
def padded_byte_model_dir(tmp_path_factory):
    return save_byte_model(tmp_path_factory.mktemp("structured-padded-gpu"), logits_per_token=4)


def save_byte_model(path, logits_per_token: int):
    """A random Llama over a byte-level tokenizer, its logits `logits_per_token` times as many
    as the tokenizer's tokens (the rest padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {piece: i for i, piece in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_end|>"])
    eos = len(vocab)
    config = transformers.LlamaConfig(
        vocab_size=(eos + 1) * logits_per_token,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engines(byte_model_dir):
    # float32: the verify step's shapes round differently from a decode step's in bf16
    kwargs = dict(model=str(byte_model_dir), dtype="float32", kv_cache_memory=1 << 28)
    return LLM(**kwargs), LLM(**kwargs, speculative_config=NGRAM)


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=0.9, seed=3)])
def test_constrained_speculation_gives_the_same_tokens_on_the_gpu(engines, kind, settings):
    plain, spec = engines
    constraint, prompt = CONSTRAINTS[kind]
    params = SamplingParams(max_tokens=80, structured_outputs=constraint, **settings)
    stats = spec.core_client.core.spec_decoding_stats
    before = stats.snapshot()
    prompts = [prompt, prompt[len(prompt) // 2 :]]  # two requests in a batch
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for completion in got:
        assert completion.finish_reason == "stop"
        if kind == "json":
            assert set(json.loads(completion.text)) == {"colour", "ok", "tags"}
        else:
            assert re.fullmatch(REGEX, completion.text), completion.text
    assert stats.num_accepted_tokens > before.num_accepted_tokens
    assert spec.config.async_scheduling


def test_padding_logits_stay_masked_under_speculation_on_the_gpu(padded_byte_model_dir):
    """Three quarters of the logits pad the tokenizer: none is sampled under a grammar, whose
    bitmask covers the tokenizer's tokens only."""
    spec = LLM(
        model=str(padded_byte_model_dir),
        dtype="float32",
        kv_cache_memory=1 << 28,
        speculative_config=NGRAM,
        enforce_eager=True,  # the mask is applied outside the graphs; eager starts at once
    )
    constraint, prompt = CONSTRAINTS["json"]
    params = SamplingParams(
        n=4, max_tokens=80, temperature=1.5, seed=5, structured_outputs=constraint
    )
    (output,) = spec.generate(prompt, params, use_tqdm=False)
    num_tokens = spec.config.model.hf_config.vocab_size // 4
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        assert set(json.loads(completion.text)) == {"colour", "ok", "tags"}
        assert max(completion.token_ids) < num_tokens
