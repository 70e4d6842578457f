"""Speculative decoding on a CUDA device: the verify step under CUDA graphs, with async
scheduling on (the GPU default), gives the tokens of decoding without drafts."""

import pytest
import torch
import transformers

from asyncllm import LLM, SamplingParams
from asyncllm.worker.step_plan import StepRunner

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


def verify_replays(llm: LLM) -> list[int]:
    """The token counts of the verify graphs the engine replays from now on."""
    runner = llm.core_client.core.executor.model_runner
    graphs = runner.graphs.get(StepRunner.VERIFY_GRAPH)
    replays: list[int] = []
    if graphs is not None:
        real = graphs.run
        graphs.run = lambda size, meta: replays.append(size) or real(size, meta)
    return replays


@pytest.mark.parametrize("n,graph_tokens", [(1, 5), (3, 20)])
def test_verify_graphs_give_the_eager_verify_steps_logits(small_vocab_dir, n, graph_tokens):
    """Uniform verify steps replay graphs of b x (k + 1) tokens (5 at batch 1, not the
    ladder's 64); eager runs pad them the same way: the same tokens and logprobs, bit for bit."""
    kwargs = dict(model=str(small_vocab_dir), kv_cache_memory=1 << 28, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    results = {}
    for eager in (True, False):
        llm = LLM(**kwargs, enforce_eager=eager, speculative_config=NGRAM)
        replays = verify_replays(llm)
        outputs = llm.generate(prompts(n), params, use_tqdm=False)
        results[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        if not eager:
            runner = llm.core_client.core.executor.model_runner
            sizes = runner.graphs[StepRunner.VERIFY_GRAPH].sizes
        llm.core_client.shutdown()
    assert graph_tokens in replays and set(replays) <= set(sizes)
    assert results[False] == results[True]
