"""The fused q/k norm + rotary + KV cache write against the torch composition it replaces.

On CPU under TRITON_INTERPRET=1 (set in conftest.py) in fp32 and fp16; with a GPU in bf16 too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_vs_hf import CONFIGS, TINY, kv_caches, metadata

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from asyncllm.attention.triton_backend import TritonAttentionBackend
from asyncllm.layers.norm import rms_norm
from asyncllm.layers.rotary import apply_rotary, build_cos_sin_cache
from asyncllm.models.llama import LlamaForCausalLM
from kernels import norm_rope_and_cache

FULL = torch.cuda.is_available()
DEVICE = "cuda" if FULL else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if FULL else [torch.float32, torch.float16]
# a few ulps: the torch path rounds after the norm and after rotary, the kernel once at the store
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
MAX_POSITION = 4096
EPS = 1e-6


def reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | tuple[()],
) -> torch.Tensor:
    """The unfused layers: per-head rms_norm, apply_rotary, write_kv_cache."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    heads = qkv.view(qkv.shape[0], -1, head_dim)
    q, k, v = heads.split([heads.shape[1] - 2 * num_kv_heads, num_kv_heads, num_kv_heads], 1)
    if norm_weights:
        q, k = rms_norm(q, norm_weights[0], EPS), rms_norm(k, norm_weights[1], EPS)
    k = apply_rotary(k, positions, cos_sin_cache)
    write_kv_cache(k, v, kv_cache, slots)
    return apply_rotary(q, positions, cos_sin_cache)


@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim",
    # below 64 tokens one head a program, from 64 on a token's KV heads (and as many query heads)
    [(1, 4, 1, 64), (3, 8, 2, 128), (17, 8, 2, 64), (17, 4, 1, 128), (3, 4, 2, 80)]
    + [(64, 8, 2, 64), (70, 9, 3, 64), (65, 4, 4, 80)],
)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_and_cache_matches_torch_composition(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: bool,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * head_dim + num_heads)
    num_blocks, block_size = 8, 16

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    qkv = rand(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    kv_cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    weights = (rand(head_dim) + 1, rand(head_dim) + 1) if qk_norm else ()
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1::3] = -1  # padding rows
    slots = slots.to(DEVICE)
    cos_sin_cache = build_cos_sin_cache(head_dim, MAX_POSITION, 1e6, None).to(DEVICE)
    ref_cache = kv_cache.clone()
    ref_q = reference(qkv, positions, cos_sin_cache, ref_cache, slots, weights)
    before = kv_cache.clone()

    q = norm_rope_and_cache(qkv, positions, cos_sin_cache, kv_cache, slots, *weights, eps=EPS)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q, ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(kv_cache[0], ref_cache[0], rtol=tol, atol=tol)
    assert torch.equal(kv_cache[1], ref_cache[1])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    untouched = untouched.view(num_blocks, block_size)
    assert torch.equal(kv_cache[:, untouched], before[:, untouched])


def test_empty_batch_launches_nothing() -> None:
    kv_cache = torch.zeros(2, 1, 16, 2, 64, device=DEVICE)
    qkv = torch.zeros(0, (4 + 2 * 2) * 64, device=DEVICE)
    cos_sin_cache = build_cos_sin_cache(64, 16, 1e4, None).to(DEVICE)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    q = norm_rope_and_cache(qkv, empty, cos_sin_cache, kv_cache, empty)
    assert q.shape == (0, 4, 64)


def on_device(meta: AttentionMetadata) -> AttentionMetadata:
    tensors = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")
    return dataclasses.replace(meta, **{f: getattr(meta, f).to(DEVICE) for f in tensors})


@pytest.mark.parametrize("name", ["llama3_rope_tied", "qwen3_qk_norm"])
@torch.inference_mode()
def test_model_on_triton_backend_matches_torch_backend(name: str) -> None:
    """A chunked prefill, a mixed chunk + decode step and a pure decode step of two requests."""
    config_class, extra = CONFIGS[name]
    # head_dim 16: the GPU prefill kernel's tl.dot needs at least 16
    config = config_class(**{**TINY, "num_attention_heads": 4}, **extra)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config, TorchAttentionBackend()).eval()
    for param_name, param in ref.named_parameters():
        if "norm" in param_name:
            param.uniform_(0.5, 1.5)
        else:  # the layers leave their weights to the loader: nn.Linear's random range
            bound = param.shape[-1] ** -0.5 if param.dim() == 2 else 0.1
            param.uniform_(-bound, bound)
    fused = LlamaForCausalLM(config, TritonAttentionBackend()).eval()
    fused.load_state_dict(ref.state_dict())
    ref.to(DEVICE), fused.to(DEVICE)
    ref_caches = [c.to(DEVICE) for c in kv_caches(ref)]
    fused_caches = [c.to(DEVICE) for c in kv_caches(fused)]
    ids = torch.randint(0, TINY["vocab_size"], (20,), generator=torch.Generator().manual_seed(1))
    tables = [[5, 2, 9, 11, 3], [1, 8, 4]]
    steps = [
        ([(0, 10), (0, 6)], ids[:16], [*range(10), *range(6)]),
        ([(10, 3), (6, 1)], ids[16:], [10, 11, 12, 6]),
        ([(13, 1), (7, 1)], ids[:2], [13, 7]),
    ]
    for spans, step_ids, positions in steps:
        meta = on_device(metadata(spans, tables))
        step_ids, positions = step_ids.to(DEVICE), torch.tensor(positions, device=DEVICE)
        expected = ref.compute_logits(ref(step_ids, positions, ref_caches, meta))
        logits = fused.compute_logits(fused(step_ids, positions, fused_caches, meta))
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
