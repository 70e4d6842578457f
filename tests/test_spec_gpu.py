"""Speculative decoding on a CUDA device: the verify step under CUDA graphs, with async
scheduling on (the GPU default), gives the tokens of decoding without drafts."""

import pytest
import torch
import transformers

from asyncllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    """Peaked distributions over 64 tokens: n-gram drafts come often and some are accepted."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("spec-gpu")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def prompts(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 64, (8 + 3 * i,), generator=gen).tolist() * 2}
            for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def engines(small_vocab_dir):
    # float32: the verify step's shapes round differently from a decode step's in bf16
    kwargs = dict(model=str(small_vocab_dir), dtype="float32", kv_cache_memory=1 << 28)
    return LLM(**kwargs), LLM(**kwargs, speculative_config=NGRAM)


@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize(
    "settings", [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=3, logprobs=2)]
)
def test_speculation_gives_the_same_tokens_on_the_gpu(engines, n, settings):
    plain, spec = engines
    params = SamplingParams(max_tokens=64, ignore_eos=True, **settings)
    stats = spec.core_client.core.spec_decoding_stats
    before = stats.num_accepted_tokens
    want = [o.outputs[0].token_ids for o in plain.generate(prompts(n), params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts(n), params, use_tqdm=False)]
    assert got == want
    assert stats.num_accepted_tokens > before
    assert spec.config.async_scheduling
