"""The engine on a CUDA device: Triton backend, CUDA graphs, the runner's own stream."""

import collections
import gc

import pytest
import torch
import transformers

import kernels.activation
import kernels.norm
from asyncllm import LLM, SamplingParams
from asyncllm.layers.quantization.fp8 import Fp8LinearMethod
from asyncllm.worker.step_plan import StepRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KV_CACHE_BYTES = 1 << 30


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    config = transformers.Qwen3Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3-tiny")
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A second small model, of other shapes (heads, head size, layers)."""
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=384,
        intermediate_size=768,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=2048,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("llama-tiny")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def prompts(n: int = 12) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 3, 16, 17, 40, 100, 255, 256, 300, 511, 700, 1000][:n]
    return [
        {"prompt_token_ids": torch.randint(10, 4096, (k,), generator=gen).tolist()} for k in lengths
    ]


def greedy(path, dtype: str = "float32", **kwargs) -> list[list[int]]:
    llm = LLM(model=str(path), kv_cache_memory=KV_CACHE_BYTES, dtype=dtype, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    assert llm.core_client.core.kv_cache_manager.usage == 0
    llm.core_client.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


def test_cuda_graphs_give_the_same_tokens_as_eager(qwen3_dir) -> None:
    eager = greedy(qwen3_dir, enforce_eager=True)
    graphs = greedy(qwen3_dir, enforce_eager=False)
    assert graphs == eager


def test_triton_backend_matches_torch_backend_in_fp32(qwen3_dir) -> None:
    triton = greedy(qwen3_dir, attention_backend="triton", enforce_eager=True)
    reference = greedy(qwen3_dir, attention_backend="torch", enforce_eager=True)
    assert triton == reference


def test_fp8_rows_quantized_by_the_norm_and_silu_kernels_give_the_same_tokens(
    llama_dir, monkeypatch
) -> None:
    """--quantization fp8 in bf16 under CUDA graphs: with the RMSNorm's and SiLU-and-mul's
    kernels quantizing the FP8 layers' rows (kernels.rms_norm_fp8, silu_and_mul_fp8, used),
    the tokens the layers give quantizing them themselves."""
    calls = collections.Counter()
    for module, name in ((kernels.norm, "rms_norm_fp8"), (kernels.activation, "silu_and_mul_fp8")):
        monkeypatch.setattr(module, name, counted(getattr(module, name), calls, name))
    fused = greedy(llama_dir, dtype="bfloat16", quantization="fp8")
    assert calls["rms_norm_fp8"] > 0 and calls["silu_and_mul_fp8"] > 0
    monkeypatch.setattr(Fp8LinearMethod, "takes_fp8_rows", lambda self, x: False)
    assert greedy(llama_dir, dtype="bfloat16", quantization="fp8") == fused


def counted(function, calls: collections.Counter, name: str):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)

    return wrapper


def test_runner_uses_graphs_for_decode(qwen3_dir) -> None:
    llm = LLM(model=str(qwen3_dir), kv_cache_memory=KV_CACHE_BYTES, max_num_seqs=16)
    runner = llm.core_client.core.executor.model_runner
    decode_graphs = runner.graphs[StepRunner.DECODE_GRAPH]
    assert runner.stream is not None
    replays = []
    real = decode_graphs.run
    decode_graphs.run = lambda size, meta: replays.append(size) or real(size, meta)
    llm.generate(prompts(5), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert replays and set(replays) <= set(decode_graphs.sizes)
    assert StepRunner.PIECEWISE_GRAPHS in runner.graphs


def record_replays(run, name: str, replays: list):
    return lambda size, meta: replays.append((name, size)) or run(size, meta)


def run_with_logprobs(path, max_num_batched_tokens: int, **kwargs):
    llm = LLM(
        model=str(path),
        kv_cache_memory=KV_CACHE_BYTES,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=16,
        **kwargs,
    )
    runner = llm.core_client.core.executor.model_runner
    replays = []
    kinds = {StepRunner.SHORT_STEP_GRAPH: "whole", StepRunner.PIECEWISE_GRAPHS: "piecewise"}
    for kind, name in kinds.items():
        if kind in runner.graphs:
            graphs = runner.graphs[kind]
            graphs.run = record_replays(graphs.run, name, replays)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2),
    ]
    outputs = llm.generate(prompts(), [params[i % 2] for i in range(12)], use_tqdm=False)
    assert llm.core_client.core.kv_cache_manager.usage == 0
    llm.core_client.shutdown()
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs
    ], replays


@pytest.mark.parametrize("max_num_batched_tokens,kind", [(512, "whole"), (2048, "piecewise")])
def test_mixed_step_graphs_match_eager_bit_for_bit(
    qwen3_dir, max_num_batched_tokens: int, kind: str
) -> None:
    """Steps with prompt tokens (chunked prefill next to decodes, prompt logprobs) replay
    whole-step graphs up to 768 tokens and piecewise graphs above, padded to the ladder;
    eager runs pad the same way: equal bits. A budget of 512 tokens chunks the prompts into
    steps for the whole-step graphs; at 2048 the prompts fill two big steps."""
    eager, eager_replays = run_with_logprobs(qwen3_dir, max_num_batched_tokens, enforce_eager=True)
    graphs, replays = run_with_logprobs(qwen3_dir, max_num_batched_tokens)
    assert not eager_replays and kind in {k for k, _ in replays}
    assert all((size <= 768) == (k == "whole") for k, size in replays)
    assert graphs == eager


# CUDA graphs on, the default dtype (bfloat16): the setting in which a second engine crashed
SMALL = {"max_num_seqs": 8, "max_num_batched_tokens": 512}
LARGE = {"max_num_seqs": 32, "max_num_batched_tokens": 2048}


def engine(path, limits: dict) -> LLM:
    return LLM(model=str(path), kv_cache_memory=KV_CACHE_BYTES, **limits)


def engine_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


def give_back_memory() -> None:
    """What a caller does between engines: the device memory goes back to the driver, so a
    pointer into it that outlived its engine faults instead of reading stale data."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def tokens_alone(path, limits: dict) -> list[list[int]]:
    llm = engine(path, limits)
    tokens = engine_tokens(llm)
    del llm
    give_back_memory()
    return tokens


def test_engines_built_one_after_another_give_the_same_tokens(qwen3_dir) -> None:
    """The same config again and another config, each after the one before is deleted."""
    first = [tokens_alone(qwen3_dir, limits) for limits in (LARGE, SMALL)]
    again = [tokens_alone(qwen3_dir, limits) for limits in (LARGE, SMALL, LARGE)]
    assert again == [*first, first[0]]


def test_two_engines_alive_at_once_give_what_each_gives_alone(qwen3_dir, llama_dir) -> None:
    """Two models on one GPU, their steps interleaved, then one deleted while the other runs on."""
    qwen3_alone, llama_alone = tokens_alone(qwen3_dir, LARGE), tokens_alone(llama_dir, SMALL)
    qwen3, llama = engine(qwen3_dir, LARGE), engine(llama_dir, SMALL)
    assert engine_tokens(llama) == llama_alone
    assert engine_tokens(qwen3) == qwen3_alone
    assert engine_tokens(llama) == llama_alone
    del qwen3
    give_back_memory()
    assert engine_tokens(llama) == llama_alone


def test_a_deleted_engine_leaves_no_device_memory_behind(qwen3_dir) -> None:
    """Its graphs, their pools, the KV cache and the buffers all go with it."""
    give_back_memory()
    before = torch.cuda.memory_allocated()
    tokens_alone(qwen3_dir, SMALL)
    # torch itself keeps a cuBLAS workspace per stream that ran a GEMM: a few MiB at most
    assert torch.cuda.memory_allocated() - before < 64 << 20
