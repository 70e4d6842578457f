"""The C++ layer ops on CPU (kernels/cpu_layer_ops.cpp) against the torch functions they stand in
for, and the layers that take them: in place, as the Triton kernels work on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncllm.layers.norm import RMSNorm, fused_add_rms_norm
from asyncllm.layers.quantization import base
from asyncllm.layers.rotary import RotaryEmbedding, apply_rotary
from kernels.cpu_layer_ops import (
    cpu_layer_ops_available,
    fused_add_rms_norm_cpu,
    refine_top_logits_cpu,
    rotary_embedding_cpu,
    silu_and_mul_bf16_cpu,
    write_kv_cache_cpu,
)

ONEDNN_BF16 = pytest.mark.skipif(
    not base.onednn_bf16(), reason="oneDNN has no bf16 GEMM on this CPU (AVX2 alone)"
)


@pytest.fixture(scope="module", autouse=True)
def built_ops() -> None:
    assert cpu_layer_ops_available()


@pytest.mark.parametrize("rows, hidden", [(0, 64), (1, 7), (17, 576), (300, 576)])
def test_fused_add_rms_norm_matches_torch_in_place(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    ref_out, ref_sum = fused_add_rms_norm(x, residual, weight, 1e-5)
    out, summed = fused_add_rms_norm_cpu(x, residual, weight, 1e-5)
    assert out.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()
    assert torch.equal(summed, ref_sum)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, hidden", [(1, 7), (17, 576), (4000, 576)])
def test_fused_add_rms_norm_takes_a_bf16_x_and_rounds_its_output_into_it(
    rows: int, hidden: int
) -> None:
    """The bf16 mode's GEMM output as x: the sum and the norm in float32, exactly as for its
    float32 copy (4,000 rows: one reduction order for both types), the normed rows rounded back
    into x as .to(bfloat16) rounds them."""
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    residual, weight = torch.randn(rows, hidden, generator=gen), torch.randn(hidden, generator=gen)
    x32, residual32 = x.float(), residual.clone()
    fused_add_rms_norm_cpu(x32, residual32, weight, 1e-5)
    out, summed = fused_add_rms_norm_cpu(x, residual, weight, 1e-5)
    assert out.data_ptr() == x.data_ptr() and out.dtype == torch.bfloat16
    assert torch.equal(summed, residual32)
    assert torch.equal(out, x32.to(torch.bfloat16))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_torch_on_qkv_slices_in_place(head_dim: int) -> None:
    num_tokens, num_heads, num_kv_heads = 20, 9, 3
    rotary = RotaryEmbedding(head_dim, 4096, 1e5, None)
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    heads = num_heads + 2 * num_kv_heads
    qkv = torch.randn(num_tokens, heads, head_dim, generator=gen)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    cache = rotary.cos_sin_cache
    expected = (apply_rotary(q, positions, cache), apply_rotary(k, positions, cache), v.clone())
    rotary_embedding_cpu(positions, q, k, rotary.cos_sin_cache)
    for got, want in zip((q, k, v), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rotary_rejects_a_position_past_its_cache() -> None:
    rotary = RotaryEmbedding(64, 16, 1e4, None)
    q, k = torch.randn(1, 2, 64), torch.randn(1, 1, 64)
    with pytest.raises(RuntimeError, match="position 16"):
        rotary_embedding_cpu(torch.tensor([16]), q, k, rotary.cos_sin_cache)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_fills_the_slots_and_skips_padding(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 6, 8, generator=gen)  # 2 query heads, 2 KV heads of 8
    _, key, value = qkv.split([2, 2, 2], dim=1)
    cache = torch.zeros(2, 4, 4, 2, 8, dtype=cache_dtype)
    slots = torch.tensor([3, -1, 14, 0, 9])
    write_kv_cache_cpu(key, value, cache, slots)
    expected = torch.zeros_like(cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0].view(-1, 2, 8)[slot] = key[t].to(cache_dtype)
            expected[1].view(-1, 2, 8)[slot] = value[t].to(cache_dtype)
    assert torch.equal(cache, expected)


def test_kv_cache_write_rejects_a_slot_past_the_cache() -> None:
    key = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="slot 16"):
        write_kv_cache_cpu(key, key, torch.zeros(2, 4, 4, 2, 8), torch.tensor([16]))


def test_layers_take_the_ops_for_float32_on_cpu() -> None:
    norm, rotary = RMSNorm(64, 1e-6), RotaryEmbedding(64, 128, 1e4, None)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    out, summed = norm(x, residual)
    assert out.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    rotated_q, rotated_k = rotary(torch.tensor([0, 5, 9]), q, k)
    assert rotated_q.data_ptr() == q.data_ptr() and rotated_k.data_ptr() == k.data_ptr()


@pytest.mark.parametrize("rows, inner", [(0, 8), (1, 7), (33, 1536), (130, 100)])
def test_silu_and_mul_bf16_rounds_the_float32_product_once(rows: int, inner: int) -> None:
    """As the float32 path computes it, then rounds into the next bf16 GEMM: equal but where
    the product lies within the exp's two float32 ulps of a bf16 rounding boundary."""
    gen = torch.Generator().manual_seed(rows + inner)
    x = (torch.randn(rows, 2 * inner, generator=gen) * 4).to(torch.bfloat16)
    x[:, :3] = torch.tensor([-90.0, 0.0, 90.0]).to(torch.bfloat16)  # the exp's clamps, silu(0)
    rows_view = torch.cat([x, x], dim=1)[:, : 2 * inner]  # strided rows, as a GEMM's padding
    gate, up = x.float().chunk(2, dim=-1)
    ref = (F.silu(gate) * up).to(torch.bfloat16)
    for source in (x, rows_view):
        out = silu_and_mul_bf16_cpu(source)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, inner)
        if rows:
            assert (out == ref).float().mean() >= 0.9999 - 1 / out.numel()
            torch.testing.assert_close(out.float(), ref.float(), rtol=2**-8, atol=1e-30)


@pytest.mark.parametrize(
    "rows, vocab, width", [(0, 100, 8), (1, 1000, 7), (3, 4099, 64), (33, 650, 576)]
)
def test_refine_top_logits_recomputes_those_within_the_margin_exactly(
    rows: int, vocab: int, width: int
) -> None:
    """Each row's logits within the margin of its largest (the largest itself, its near ties,
    one just inside and one just outside the margin, in chunks of 64 and a short last one) become
    the float32 dot products; all others stay as they were, bit for bit."""
    gen = torch.Generator().manual_seed(rows + vocab)
    hidden, weight = (
        torch.randn(rows, width, generator=gen),
        torch.randn(vocab, width, generator=gen),
    )
    exact = (hidden.double() @ weight.double().T).float()
    logits = exact + torch.randn(rows, vocab, generator=gen) * 0.3  # a bf16 GEMM's errors
    logits[:, -1] += 6.0  # the largest in the short last chunk
    top = logits.amax(-1, keepdim=True)
    logits[:, 5] = top[:, 0] - 0.999  # just inside
    logits[:, 70] = top[:, 0] - 1.001  # just outside
    near = logits >= top - 1.0
    before = logits.clone()
    for refine in (refine_top_logits_cpu, refine_top_logits_by_torch):
        out = refine(before.clone(), hidden, weight, 1.0)
        assert torch.equal(out[~near], before[~near])
        torch.testing.assert_close(out[near], exact[near], rtol=1e-5, atol=1e-5)
        if rows:
            assert near[:, 5].all() and not near[:, 70].any() and near.sum() < rows * vocab / 50


def refine_top_logits_by_torch(logits, hidden, weight, margin):
    from asyncllm.layers.quantization import cpu_bf16

    with pytest.MonkeyPatch.context() as patch:  # the engine's path where the ops cannot build
        patch.setattr(cpu_bf16, "cpu_layer_ops_available", lambda: False)
        return cpu_bf16.refine_top_logits(logits, hidden, weight, margin)


@ONEDNN_BF16
def test_bf16_mode_lm_head_refines_its_top_logits_from_its_own_float32_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An untied lm_head in the bf16 mode (oneDNN's GEMM, as on a CPU with bf16 dot products):
    packed in bf16, its float32 parameter kept; the logits within the margin of each row's
    largest are the float32 dot products, the others the bf16 GEMM's, and the argmax is fp32's."""
    monkeypatch.setattr(base, "native_bf16", lambda: True)
    from asyncllm.layers.quantization.cpu_bf16 import REFINE_MARGIN, CpuBf16Config
    from asyncllm.layers.vocab_parallel_embedding import ParallelLMHead

    torch.manual_seed(0)
    head = ParallelLMHead(300, 64, prefix="lm_head", quant_config=CpuBf16Config())
    head.weight.data.normal_(0, 0.3)
    weight = head.weight.detach().clone()
    head.quant_method.process_weights_after_loading(head)
    assert head.weight.dtype == torch.bfloat16 and torch.equal(head.float32_weight, weight)
    hidden = torch.randn(7, 64)
    logits = head(hidden)
    exact = (hidden.double() @ weight.double().T).float()
    near = logits >= logits.amax(-1, keepdim=True) - REFINE_MARGIN
    torch.testing.assert_close(logits[near], exact[near], rtol=1e-5, atol=1e-5)
    bf16 = hidden.to(torch.bfloat16).float() @ weight.to(torch.bfloat16).float().T
    bf16 = bf16.to(torch.bfloat16).float()  # oneDNN's bf16 GEMM writes bf16
    # within a bf16 ulp: another order of the sums may round to the neighbour
    torch.testing.assert_close(logits[~near], bf16[~near], rtol=2**-7, atol=1e-6)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


@ONEDNN_BF16
def test_bf16_mode_mlp_keeps_gate_up_in_bf16_and_returns_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bf16 mode's MLP in oneDNN's GEMMs (a CPU with bf16 dot products): gate_up's GEMM
    output goes to the SiLU-and-mul as bf16 and the down projection's output comes back in
    float32: bf16 operands, float32 sums, each GEMM's output rounded to bf16 (within a rounding
    of the sums' order)."""
    monkeypatch.setattr(base, "native_bf16", lambda: True)
    from asyncllm.layers.quantization.cpu_bf16 import CpuBf16Config
    from asyncllm.models.llama import MLP

    torch.manual_seed(0)
    mlp = MLP(64, 96, CpuBf16Config(), "mlp")
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.data.normal_(0, 0.1)
    weights = [layer.weight.detach().clone() for layer in (mlp.gate_up_proj, mlp.down_proj)]
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, 64)
    gate_up = mlp.gate_up_proj(x)
    assert gate_up.dtype == torch.bfloat16
    out = mlp(x)
    assert out.dtype == torch.float32
    bf16 = [w.to(torch.bfloat16).float() for w in weights]
    gate, up = (x.to(torch.bfloat16).float() @ bf16[0].T).to(torch.bfloat16).float().chunk(2, -1)
    act = (F.silu(gate) * up).to(torch.bfloat16).float()
    ref = (act @ bf16[1].T).to(torch.bfloat16).float()  # oneDNN's bf16 GEMM writes bf16
    torch.testing.assert_close(out, ref, rtol=2**-8, atol=1e-6)
