"""The FP8 KV cache (--kv-cache-dtype fp8): keys and values stored in e4m3, read back widened.

Attention over an FP8 cache equals attention over an fp32 cache holding the same e4m3-rounded
keys and values, on the torch backend's paths and the Triton decode and prefill kernels (under
TRITON_INTERPRET=1 on CPU); the Triton KV write rounds as torch does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_kernels_attention import make_batch, relative_error

from asyncllm.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from asyncllm.attention.triton_backend import TritonAttentionBackend
from asyncllm.config import CacheConfig
from kernels import reshape_and_cache
from kernels.decode_attention import LONG_TILE_MIN_SEQS, default_decode_config

FP8 = torch.float8_e4m3fn
# a mixed step: decodes beside a prompt and a chunk continued over cached tokens, padding rows
QUERY_LENS, SEQ_LENS = [1, 24, 1, 6], [33, 24, 2, 70]


@pytest.mark.parametrize(
    "backend",
    [
        TorchAttentionBackend(),
        TorchAttentionBackend(use_cpu_kernel=False),
        TritonAttentionBackend(),
    ],
    ids=["torch", "torch-reference", "triton"],
)
@pytest.mark.parametrize("query_lens", [QUERY_LENS, [1] * len(SEQ_LENS)], ids=["mixed", "decode"])
def test_attention_over_an_fp8_cache_equals_the_rounded_values(backend, query_lens) -> None:
    query, key, value, cache, meta = make_batch(
        query_lens, SEQ_LENS, 8, 2, 64, torch.float32, padding_tokens=2
    )
    cache = cache.to(FP8)
    write_kv_cache(key, value, cache, meta.slot_mapping)
    rounded = cache.float()
    out = backend.attend(query, cache, meta, 0.125)
    ref = TorchAttentionBackend(use_cpu_kernel=False).attend(query, rounded, meta, 0.125)
    n = sum(query_lens)
    assert relative_error(out[:n], ref[:n]) < 1e-5


def test_decode_reads_an_fp8_cache_in_tiles_of_twice_the_keys() -> None:
    """The same bytes a tile as a 16-bit cache (the triton case above runs fp32 queries, so
    64-key tiles over its FP8 cache)."""
    for dtype, seqs in [(torch.bfloat16, LONG_TILE_MIN_SEQS), (torch.float32, 1)]:
        wide = default_decode_config(dtype, seqs, FP8).block_n
        assert wide == 2 * default_decode_config(dtype, seqs, dtype).block_n


def test_the_triton_kv_write_rounds_as_torch_does() -> None:
    """Exact on a GPU; TRITON_INTERPRET's fp32 -> e4m3 conversion sends a few values that
    round up to a power of two to the binade below, so on CPU most must agree."""
    _, key, value, cache, meta = make_batch(
        QUERY_LENS, SEQ_LENS, 8, 2, 64, torch.float32, padding_tokens=2
    )
    cache = cache.to(FP8)
    expected = cache.clone()
    reshape_and_cache(key, value, cache, meta.slot_mapping)
    write_kv_cache(key, value, expected, meta.slot_mapping)
    agree = (cache.float() == expected.float()).float().mean().item()
    assert agree == 1.0 if torch.cuda.is_available() else agree > 0.99


def test_kv_cache_dtype_is_checked_and_fp8_halves_a_bf16_cache() -> None:
    config = CacheConfig(16, None, 0.9, None, True, kv_cache_dtype="fp8")
    assert config.cache_dtype(torch.bfloat16) == FP8
    assert CacheConfig(16, None, 0.9, None, True).cache_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(16, None, 0.9, None, True, kv_cache_dtype="int8")


def test_an_engine_generates_over_an_fp8_cache(tmp_path: Path, tiny_model_dir: Path) -> None:
    from asyncllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_model_dir), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64)
    runner = llm.core_client.core.executor.model_runner
    assert runner.kv_caches[0].dtype == FP8
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 2, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graphs_run_over_an_fp8_cache(tmp_path: Path) -> None:
    """The piecewise graphs' buffers between the pieces hold activations, in the model's dtype
    (they once took the cache's, and o_proj got e4m3 input)."""
    from asyncllm import LLM, SamplingParams

    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    llm = LLM(
        model=str(tmp_path),
        load_format="dummy",
        kv_cache_dtype="fp8",
        max_model_len=2048,
        gpu_memory_utilization=0.2,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + i % 1000 for i in range(n)]} for n in (5, 5, 1500)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8, 8]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
