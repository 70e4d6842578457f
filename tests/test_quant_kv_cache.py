"""The FP8 KV cache (--kv-cache-dtype fp8): keys and values stored in e4m3, read back widened.

Attention over an FP8 cache equals attention over an fp32 cache holding the same e4m3-rounded
keys and values times the layer's scales, on the torch backend's paths and the Triton decode
and prefill kernels (under TRITON_INTERPRET=1 on CPU); every KV write (torch, the Triton
reshape_and_cache and the fused norm/rotary/write) stores e4m3(k / k_scale) as torch rounds it,
saturated at +-448.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_kernels_attention import (
    DEVICE,
    FULL,
    TOLERANCE,
    make_batch,
    reference_attention,
    relative_error,
)

from asyncllm.attention.kv_scales import UNIT_KV_SCALES, KVScales
from asyncllm.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from asyncllm.attention.triton_backend import TritonAttentionBackend
from asyncllm.config import CacheConfig
from asyncllm.layers.rotary import build_cos_sin_cache
from kernels import norm_rope_and_cache, reshape_and_cache
from kernels.decode_attention import (
    LONG_TILE_MIN_SEQS,
    Fp8CacheRead,
    default_decode_config,
    paged_decode_attention,
)

FP8 = torch.float8_e4m3fn
# a mixed step: decodes beside a prompt and a chunk continued over cached tokens, padding rows
QUERY_LENS, SEQ_LENS = [1, 24, 1, 6], [33, 24, 2, 70]
SCALES = KVScales(k=3.0, v=0.7)


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
@pytest.mark.parametrize("kv_scales", [UNIT_KV_SCALES, SCALES], ids=["unscaled", "scaled"])
def test_attention_over_an_fp8_cache_equals_the_rounded_values(
    backend, query_lens, kv_scales
) -> None:
    query, key, value, cache, meta = make_batch(
        query_lens, SEQ_LENS, 8, 2, 64, torch.float32, padding_tokens=2
    )
    cache = cache.to(FP8)
    write_kv_cache(key, value, cache, meta.slot_mapping, kv_scales)
    rounded = cache.float()
    rounded[0] *= kv_scales.k
    rounded[1] *= kv_scales.v
    out = backend.attend(query, cache, meta, 0.125, kv_scales=kv_scales)
    # an fp32 cache ignores the scales: the reference attends over the widened values as they are
    ref = TorchAttentionBackend(use_cpu_kernel=False).attend(
        query, rounded, meta, 0.125, kv_scales=kv_scales
    )
    n = sum(query_lens)
    assert relative_error(out[:n], ref[:n]) < 1e-5


def test_decode_tiles_over_an_fp8_cache_are_the_measured_ones() -> None:
    """16-bit queries: 128-key tiles, two stages once the batch fills the device, three when
    the context is split (the H200 sweep); fp32 queries (the triton case above) read twice the
    keys of their 16-bit cache's tile, the same bytes."""
    for seqs, stages in [(LONG_TILE_MIN_SEQS, 2), (1, 3)]:
        config = default_decode_config(torch.bfloat16, seqs, FP8)
        assert (config.block_n, config.num_stages) == (128, stages)
    wide = default_decode_config(torch.float32, 1, FP8).block_n
    assert wide == 2 * default_decode_config(torch.float32, 1, torch.float32).block_n


# fp16 dots keep a bf16 query exact: only the output's rounding to bf16 remains, at most 2^-8
# of each value (the interpreter truncates; the GPU rounds, half that)
BF16_OUTPUT = 4.5e-3
# prmt_pairs (inline PTX) only runs on a GPU: on CPU the last read is the first
READS = [Fp8CacheRead(fp16, pairs) for fp16 in (True, False) for pairs in (True, False)]
READS += [Fp8CacheRead(prmt_pairs=False)] if FULL else []
# on CPU the interpreter cannot compute bf16: a bf16 query there only with fp16 dots
READ_CASES = [
    (read, dtype)
    for read in READS
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    if FULL or dtype != torch.bfloat16 or read.fp16_dots
]


def fp8_decode_error(
    query: torch.Tensor, cache: torch.Tensor, meta, scale: float, **kwargs
) -> float:
    """The decode kernel over an FP8 cache against float64 attention over its widened values."""
    out = paged_decode_attention(
        query, cache, meta.block_tables, meta.seq_lens, scale, k_scale=3.0, v_scale=0.7, **kwargs
    )
    widened = cache.double()
    widened[0] *= 3.0
    widened[1] *= 0.7
    return relative_error(out, reference_attention(query, widened, meta, scale))


@pytest.mark.parametrize("read,dtype", READ_CASES, ids=str)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,num_splits",
    # value pairs past the head dim masked (40 in 64 columns), three query heads a KV head;
    # an odd head dim reads the values one by one
    [(6, 2, 40, 3), (2, 2, 15, 1)],
)
def test_decode_reads_an_fp8_cache_alike_every_way(
    read, dtype, num_heads, num_kv_heads, head_dim, num_splits
) -> None:
    query, _, _, cache, meta = make_batch(
        [1] * 4, [1, 17, 40, 70], num_heads, num_kv_heads, head_dim, torch.float32
    )
    error = fp8_decode_error(
        query.to(dtype), cache.to(FP8), meta, head_dim**-0.5, num_splits=num_splits, fp8_read=read
    )
    tolerance = BF16_OUTPUT if dtype == torch.bfloat16 and read.fp16_dots else TOLERANCE[dtype]
    assert error < tolerance


@pytest.mark.parametrize("magnitude", [2.0**24, 2.0**-30])
def test_fp16_dots_scale_a_bf16_query_past_fp16s_range(magnitude: float) -> None:
    """2^24 overflows fp16 (65,504), 2^-30 is below its smallest subnormal (2^-24)."""
    query, _, _, cache, meta = make_batch([1] * 3, [5, 33, 20], 4, 2, 64, torch.float32)
    error = fp8_decode_error(
        (query * magnitude).to(torch.bfloat16), cache.to(FP8), meta, 0.125 / magnitude
    )
    assert error < BF16_OUTPUT


def test_the_triton_kv_write_rounds_as_torch_does() -> None:
    _, key, value, cache, meta = make_batch(
        QUERY_LENS, SEQ_LENS, 8, 2, 64, torch.float32, padding_tokens=2
    )
    cache = cache.to(FP8)
    expected = cache.clone()
    reshape_and_cache(key, value, cache, meta.slot_mapping)
    write_kv_cache(key, value, expected, meta.slot_mapping)
    assert_stores(cache, expected)


def assert_stores(cache: torch.Tensor, expected: torch.Tensor) -> None:
    """The same e4m3 values: exactly on a GPU. On CPU TRITON_INTERPRET's fp32 -> e4m3
    conversion sends a value that rounds up to a power of two to the binade below (31.4 -> 16,
    not 32), and one of at most 2^-6 a subnormal step (2^-9) towards zero: those alone may
    differ there, and by exactly that."""
    got, want = cache.float(), expected.float()
    got, want = got[got != want], want[got != want]
    if torch.cuda.is_available():
        assert want.numel() == 0
    halved = (torch.frexp(want)[0].abs() == 0.5) & (got == want / 2)
    subnormal_step = (want.abs() <= 2**-6) & ((want - got) * want.sign() == 2**-9)
    assert (halved | subnormal_step).all()
    assert want.numel() < 0.05 * cache.numel()


def large_keys_and_values() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KVScales]:
    """Keys far past e4m3's 448 and small values, the per-tensor scales that fit each in
    (max |x| / scale = 300), and the slots of a padded step."""
    gen = torch.Generator().manual_seed(5)
    key = torch.randn(37, 2, 64, generator=gen) * 1000
    value = torch.randn(37, 2, 64, generator=gen) * 0.01
    slots = torch.randperm(4 * 16, generator=gen)[:37]
    slots[::5] = -1
    scales = KVScales(k=key.abs().max().item() / 300, v=value.abs().max().item() / 300)
    return key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), scales


def stored_bytes(x: torch.Tensor, scale: float, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The torch reference: e4m3(x / scale) for the rows written, as bytes."""
    valid = slots >= 0
    return (x[valid] / scale).to(FP8).view(torch.uint8), slots[valid]


@pytest.mark.parametrize("writer", ["torch", "triton"])
def test_the_fp8_cache_holds_keys_and_values_divided_by_their_scales(writer) -> None:
    key, value, slots, scales = large_keys_and_values()
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=FP8, device=DEVICE)
    if writer == "torch":
        write_kv_cache(key, value, cache, slots, scales)
    else:
        reshape_and_cache(key, value, cache, slots, scales.k, scales.v)
    expected = torch.zeros_like(cache)
    for plane, (x, scale) in enumerate([(key, scales.k), (value, scales.v)]):
        rows, valid_slots = stored_bytes(x, scale, slots)
        expected[plane].view(-1, 2, 64).view(torch.uint8)[valid_slots] = rows
    assert scales.k > 10 and scales.v < 1e-3  # neither is near 1: the scale is really applied
    if writer == "torch":
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert_stores(cache, expected)


@pytest.mark.parametrize("writer", ["torch", "triton"])
def test_without_scales_keys_past_e4m3s_range_saturate(writer) -> None:
    """Today's behaviour without checkpoint scales (1.0): +-448, not NaN."""
    key, value, slots, _ = large_keys_and_values()
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=FP8, device=DEVICE)
    (write_kv_cache if writer == "torch" else reshape_and_cache)(key, value, cache, slots)
    keys = cache[0].float().view(-1, 2, 64)[slots[slots >= 0]]
    assert not keys.isnan().any() and keys.abs().max() == 448
    assert (keys.abs() == 448).float().mean() > 0.3


def test_the_fused_qkv_write_divides_by_the_scales() -> None:
    """norm_rope_and_cache into an FP8 cache with scales stores e4m3(rotated k / k_scale) and
    e4m3(v / v_scale): the keys it rotates into an fp32 cache, divided and rounded by torch."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    key, value, slots, scales = large_keys_and_values()
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(key.shape[0], num_heads, head_dim, generator=gen).to(DEVICE)
    qkv = torch.cat([query, key, value], dim=1).flatten(1)
    positions = torch.randint(0, 512, (key.shape[0],), generator=gen).to(DEVICE)
    cos_sin = build_cos_sin_cache(head_dim, 512, 1e4, None).to(DEVICE)
    wide = torch.zeros(2, 4, 16, num_kv_heads, head_dim, device=DEVICE)
    norm_rope_and_cache(qkv, positions, cos_sin, wide, slots)
    cache = torch.zeros_like(wide, dtype=FP8)
    norm_rope_and_cache(qkv, positions, cos_sin, cache, slots, k_scale=scales.k, v_scale=scales.v)
    expected = torch.zeros_like(cache)
    expected[0] = (wide[0] / scales.k).to(FP8)
    expected[1] = (wide[1] / scales.v).to(FP8)
    assert_stores(cache, expected)
    assert cache[0].float().abs().max() < 448  # nothing saturated


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
