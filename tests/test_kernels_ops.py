"""Fused norm, rotary and activation kernels against the torch layers they replace.

On CPU these run under TRITON_INTERPRET=1 (set in conftest.py) in fp32 and fp16; with a GPU in
bf16 too, at model-sized widths.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.layers import activation, norm, rotary
from kernels import fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul

FULL = torch.cuda.is_available()
DEVICE = "cuda" if FULL else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if FULL else [torch.float32, torch.float16]
# one rounding step of the output dtype (the kernels round once where torch may round twice)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
HIDDEN = [576, 1024, 4096] if FULL else [576]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(dtype: torch.dtype, hidden: int) -> None:
    x = randn(7, hidden, dtype=dtype)
    weight = randn(hidden, dtype=dtype)
    ref = norm.rms_norm(x, weight, 1e-6)
    assert relative_error(rms_norm(x, weight, 1e-6), ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_both_in_place(dtype: torch.dtype, hidden: int) -> None:
    x, residual = randn(5, hidden, dtype=dtype), randn(5, hidden, dtype=dtype)
    weight = randn(hidden, dtype=dtype)
    ref_out, ref_sum = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert out.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()
    assert torch.equal(summed, ref_sum)
    assert relative_error(out, ref_out) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_matches_torch_on_qkv_slices(dtype: torch.dtype, head_dim: int) -> None:
    num_tokens, num_heads, num_kv_heads = 9, 4, 2
    cache = rotary.build_cos_sin_cache(head_dim, 4096, 1e6, None).to(DEVICE)
    positions = torch.tensor([0, 1, 2, 17, 100, 4095, 5, 6, 7], device=DEVICE)
    # q and k as views into one fused qkv output, the way the attention layer splits it
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    ref_q, ref_k = (
        rotary.apply_rotary(q, positions, cache),
        rotary.apply_rotary(k, positions, cache),
    )
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    out_q, out_k = rotary_embedding(positions, q, k, cache)
    assert out_q.data_ptr() == q.data_ptr()
    assert relative_error(out_q, ref_q) < TOLERANCE[dtype]
    assert relative_error(out_k, ref_k) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_rotary_turns_mla_rope_slices_in_place(dtype: torch.dtype) -> None:
    """DeepSeek's layout: each head's rope part after its nope part, the rope key after the
    latent; pairs (2i, 2i + 1); everything around the slices left alone."""
    num_tokens, num_heads, nope, rope, rank = 5, 3, 16, 64, 40
    cache = rotary.build_cos_sin_cache(rope, 512, 1e4, None).to(DEVICE)
    positions = torch.tensor([0, 3, 511, 7, 100], device=DEVICE)
    query = randn(num_tokens, num_heads, nope + rope, dtype=dtype)
    latent = randn(num_tokens, rank + rope, dtype=dtype)
    q_pe, k_pe = query[..., nope:], latent[:, None, rank:]
    ref_q = rotary.apply_rotary(q_pe, positions, cache, interleaved=True)
    ref_k = rotary.apply_rotary(k_pe, positions, cache, interleaved=True)
    untouched = query[..., :nope].clone(), latent[:, :rank].clone()
    rotary_embedding(positions, q_pe, k_pe, cache, interleaved=True)
    assert relative_error(q_pe, ref_q) < TOLERANCE[dtype]
    assert relative_error(k_pe, ref_k) < TOLERANCE[dtype]
    assert torch.equal(query[..., :nope], untouched[0])
    assert torch.equal(latent[:, :rank], untouched[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place_on_a_slice_of_wider_rows(dtype: torch.dtype) -> None:
    latent = randn(6, 576, dtype=dtype)
    c, rope_before = latent[:, :512], latent[:, 512:].clone()
    weight = randn(512, dtype=dtype)
    ref = norm.rms_norm(c.clone(), weight, 1e-6)
    assert rms_norm(c, weight, 1e-6, out=c).data_ptr() == latent.data_ptr()
    assert relative_error(c, ref) < TOLERANCE[dtype]
    assert torch.equal(latent[:, 512:], rope_before)


def test_in_place_layers_agree_with_their_returning_forms() -> None:
    """RotaryEmbedding.rotate_ and RMSNorm.normalize_, the way DeepSeek's MLA calls them."""
    layer = rotary.RotaryEmbedding(8, 64, 1e4, None, interleaved=True).to(DEVICE)
    positions = torch.tensor([2, 9], device=DEVICE)
    q, k = randn(2, 4, 8, dtype=torch.float32), randn(2, 1, 8, dtype=torch.float32)
    ref_q, ref_k = (rotary.apply_rotary(t, positions, layer.cos_sin_cache, True) for t in (q, k))
    layer.rotate_(positions, q, k)
    torch.testing.assert_close((q, k), (ref_q, ref_k))
    rows = randn(3, 20, dtype=torch.float32)
    layer_norm = norm.RMSNorm(16, 1e-6).to(DEVICE)
    ref = norm.rms_norm(rows[:, :16].clone(), layer_norm.weight, 1e-6)
    layer_norm.normalize_(rows[:, :16])
    torch.testing.assert_close(rows[:, :16], ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    width = 3072 if FULL else 1500  # not a multiple of the kernel's 1024-column block
    x = randn(6, 2 * width, dtype=dtype)
    assert relative_error(silu_and_mul(x), activation.silu_and_mul(x)) < TOLERANCE[dtype]


def test_empty_batches_launch_nothing() -> None:
    x = randn(0, 64, dtype=torch.float32)
    assert rms_norm(x, randn(64, dtype=torch.float32), 1e-6).shape == (0, 64)
    assert silu_and_mul(x).shape == (0, 32)


def test_transformers_does_not_mistake_ours_for_hf_kernels() -> None:
    from transformers.utils.import_utils import is_kernels_available

    assert not is_kernels_available()
