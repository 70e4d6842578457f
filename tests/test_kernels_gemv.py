"""The one-row GEMV kernels against torch: plain, with RMSNorm (and the residual add) before
the GEMM, and with SiLU-and-mul before it; and the layer helpers that dispatch to them.

On CPU under TRITON_INTERPRET=1 (set in conftest.py) in fp32 and fp16 on small awkward shapes;
with a GPU also in bf16 on the Qwen3-0.6B and Llama-3.1-8B decode shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

import kernels
from asyncllm.layers.activation import silu_and_mul
from asyncllm.layers.linear import (
    FUSED_MAX_ROW,
    ReplicatedLinear,
    rms_norm_linear,
    silu_and_mul_linear,
)
from asyncllm.layers.norm import RMSNorm, fused_add_rms_norm, rms_norm
from kernels import gemv, rms_norm_gemv, silu_and_mul_gemv
from kernels._common import configs_by_shape
from kernels.gemv_kernels import (
    GEMV_BY_SHAPE,
    GemvConfig,
    choose_gemv_config,
    choose_norm_gemv_config,
    gemv_config,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# fp32 only reorders the sum; 16-bit outputs add one rounding (half an ulp) at the store
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (N, K) of each GEMM of a decode step: qkv_proj, o_proj, gate_up_proj, down_proj, lm_head
QWEN3_0_6B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
LLAMA_3_1_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
# Qwen3-30B-A3B's qkv_proj and o_proj (a GEMV_BY_SHAPE entry)
QWEN3_30B_A3B = [(5120, 2048), (2048, 4096)]
# N, K: one row and one column, odd sizes, an odd N at K = 2048 (the 8-warp tile), K over one
# 4096-value tile (a K loop)
AWKWARD = [(1, 64), (17, 96), (1000, 1000), (1027, 2048), (33, 5000)]


def Linear(input_size: int, output_size: int, bias: bool = True) -> ReplicatedLinear:
    """A one-rank linear layer with nn.Linear's random initialisation."""
    linear = ReplicatedLinear(input_size, output_size, bias=bias)
    for param in linear.parameters():
        param.data.uniform_(-(input_size**-0.5), input_size**-0.5)
    return linear


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def weights(n: int, k: int, dtype: torch.dtype, bias: bool):
    """Scaled so every output is about N(0, 1) whatever K is."""
    w = randn(n, k, dtype=dtype, seed=n + k, scale=k**-0.5)
    return w, randn(n, dtype=dtype, seed=n) if bias else None


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def linear_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    return out.to(x.dtype)


@pytest.mark.parametrize("n, k", AWKWARD)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_torch(n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    x = randn(1, k, dtype=dtype, seed=k)
    w, b = weights(n, k, dtype, bias)
    assert_close(gemv(x, w, b), linear_reference(x, w, b))


@pytest.mark.parametrize("n, k", AWKWARD)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_gemv_matches_norm_then_linear(
    n: int, k: int, with_residual: bool, dtype: torch.dtype
) -> None:
    x = randn(1, k, dtype=dtype, seed=k)
    residual = randn(1, k, dtype=dtype, seed=k + 1) if with_residual else None
    norm_weight = randn(k, dtype=dtype, seed=k + 2).abs() + 0.5
    w, b = weights(n, k, dtype, bias=True)
    inputs = [t.clone() for t in (x, residual) if t is not None]
    if residual is None:
        normed, summed = rms_norm(x, norm_weight, 1e-6), x
    else:
        normed, summed = fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    out, residual_out = rms_norm_gemv(x, residual, norm_weight, 1e-6, w, b)
    assert_close(out, linear_reference(normed, w, b))
    torch.testing.assert_close(residual_out, summed, rtol=0, atol=0)
    assert all(torch.equal(a, t) for a, t in zip(inputs, (x, residual)))  # nothing written


@pytest.mark.parametrize("n, k", AWKWARD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_gemv_matches_activation_then_linear(
    n: int, k: int, dtype: torch.dtype
) -> None:
    x = randn(1, 2 * k, dtype=dtype, seed=k)
    w, b = weights(n, k, dtype, bias=False)
    assert_close(silu_and_mul_gemv(x, w, b), linear_reference(silu_and_mul(x), w, b))


@pytest.mark.parametrize("config", [GemvConfig(1, 64), GemvConfig(8, 128), GemvConfig(16, 512)])
def test_config_only_changes_speed(config: GemvConfig) -> None:
    x = randn(1, 1000, dtype=torch.float32, seed=0)
    w, b = weights(40, 1000, torch.float32, bias=True)
    assert_close(gemv(x, w, b, config), linear_reference(x, w, b))


# programs taking row blocks in turn (8 programs on CPU): N off the blocks, K off the tile,
# more blocks than programs, fewer; K past the tile falls back to a program a block
@pytest.mark.parametrize("config", [
    GemvConfig(4, 1024, programs_per_sm=1), GemvConfig(2, 1024, programs_per_sm=2),
    GemvConfig(16, 1024, programs_per_sm=1), GemvConfig(4, 256, programs_per_sm=1),
])  # fmt: skip
def test_programs_taking_row_blocks_in_turn_only_change_speed(config: GemvConfig) -> None:
    x = randn(1, 1000, dtype=torch.float32, seed=0)
    w, b = weights(75, 1000, torch.float32, bias=True)
    assert_close(gemv(x, w, b, config), linear_reference(x, w, b))


@pytest.mark.parametrize("n, k", QWEN3_0_6B + LLAMA_3_1_8B)
def test_config_gives_every_h200_sm_three_programs_and_covers_k(n: int, k: int) -> None:
    config = choose_gemv_config(n, k)
    assert triton.cdiv(n, config.block_n) >= 3 * 132
    assert config.block_k <= 4096 and (config.block_k >= k or config.block_k == 4096)


def test_shapes_in_the_table_take_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A swept shape runs its table entry, others the rule; the environment's entries (a
    sweep's winners) add to and override the table."""
    monkeypatch.setenv("ASYNCLLM_GEMV", '{"1000x1000": {"block_n": 8, "block_k": 256}}')
    configs_by_shape.cache_clear()
    try:
        assert (
            gemv_config(151936, 1024)
            == GEMV_BY_SHAPE[151936, 1024]
            != choose_gemv_config(151936, 1024)
        )
        assert gemv_config(1000, 1000) == GemvConfig(block_n=8, block_k=256)
        assert gemv_config(1000, 1000, norm_first=True) == GemvConfig(block_n=8, block_k=256)
        assert gemv_config(1027, 2048) == choose_gemv_config(1027, 2048)
    finally:
        configs_by_shape.cache_clear()


@pytest.mark.parametrize("n, k", [(4096, 1024), (6144, 1024), (5120, 2048), (960, 576)])
def test_norm_first_rule_shares_the_norm_over_eight_rows_while_every_sm_gets_three(
    n: int, k: int
) -> None:
    """Qwen3-0.6B's qkv and gate_up, Qwen3-30B-A3B's qkv (the sweep's winners), and
    SmolLM2-135M's qkv, whose 960 rows in eights would leave H200 SMs idle."""
    config = gemv_config(n, k, norm_first=True)
    assert config == choose_norm_gemv_config(n, k)
    assert config.block_n == (8 if n >= 8 * 3 * 132 else 2)
    assert triton.cdiv(n, config.block_n) >= 3 * 132 or config.block_n == 2
    assert config.block_k == min(triton.next_power_of_2(k), 1024) and config.num_warps == 4


@pytest.mark.parametrize("n, k", [(45, 2500), (3173, 1000)])
def test_norm_first_rule_only_changes_speed(n: int, k: int) -> None:
    """Eight rows a program over N off the blocks, K over several tiles and off the last."""
    x, residual = randn(1, k, dtype=torch.float32, seed=1), randn(1, k, dtype=torch.float32, seed=2)
    norm_weight = randn(k, dtype=torch.float32, seed=3).abs() + 0.5
    w, b = weights(n, k, torch.float32, bias=True)
    normed, summed = fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    config = GemvConfig(block_n=8, block_k=1024, num_warps=4)
    out, residual_out = rms_norm_gemv(x, residual, norm_weight, 1e-6, w, b, config)
    assert_close(out, linear_reference(normed, w, b))
    torch.testing.assert_close(residual_out, summed, rtol=0, atol=0)


def test_layer_helpers_fall_back_to_the_unfused_ops_off_cuda() -> None:
    torch.manual_seed(0)
    norm, linear, down = RMSNorm(48, 1e-6), Linear(48, 20, bias=True), Linear(10, 48)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual, gate_up = torch.randn(3, 48), torch.randn(3, 48), torch.randn(3, 20)
    expected_normed, expected_residual = fused_add_rms_norm(x, residual, norm.weight, 1e-6)
    out, residual_out = rms_norm_linear(norm, linear, x, residual)
    torch.testing.assert_close(out, F.linear(expected_normed, linear.weight, linear.bias))
    torch.testing.assert_close(residual_out, expected_residual)
    out, residual_out = rms_norm_linear(norm, linear, x, None)
    torch.testing.assert_close(
        out, F.linear(rms_norm(x, norm.weight, 1e-6), linear.weight, linear.bias)
    )
    assert residual_out is x
    torch.testing.assert_close(silu_and_mul_linear(down, gate_up), down(silu_and_mul(gate_up)))


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("n, k", QWEN3_0_6B + LLAMA_3_1_8B + QWEN3_30B_A3B)
def test_gemv_matches_torch_on_model_shapes_in_bf16(n: int, k: int) -> None:
    x = randn(1, k, dtype=torch.bfloat16, seed=k)
    w, _ = weights(n, k, torch.bfloat16, bias=False)
    assert_close(gemv(x, w), linear_reference(x, w, None))


def counting(kernel, calls: list[str]):
    def counted(*args, **kwargs):
        calls.append(kernel.__name__)
        return kernel(*args, **kwargs)

    return counted


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(
    "rows, hidden, fused",
    [(1, 256, True), (2, 256, False), (1, FUSED_MAX_ROW + 128, False)],
)
def test_layer_helpers_fuse_only_single_short_cuda_rows(
    rows: int, hidden: int, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One short row: the fused kernels; more rows or a longer row: the unfused ops; all
    match the torch reference."""
    calls: list[str] = []
    for name in ("rms_norm_gemv", "silu_and_mul_gemv"):
        monkeypatch.setattr(kernels, name, counting(getattr(kernels, name), calls))
    dtype = torch.bfloat16
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    linear = Linear(hidden, 384, bias=True).to(DEVICE, dtype)
    down = Linear(hidden, 256).to(DEVICE, dtype)
    x = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn_like(x)
    gate_up = torch.randn(rows, 2 * hidden, device=DEVICE, dtype=dtype)
    summed = (x.float() + residual.float()).to(dtype)
    normed = rms_norm(summed, norm.weight, 1e-6)
    with torch.inference_mode():
        out, residual_out = rms_norm_linear(norm, linear, x.clone(), residual.clone())
        activated = silu_and_mul_linear(down, gate_up)
    assert_close(out, linear_reference(normed, linear.weight, linear.bias))
    torch.testing.assert_close(residual_out, summed, rtol=0, atol=0)
    assert_close(activated, linear_reference(silu_and_mul(gate_up), down.weight, down.bias))
    assert len(calls) == (2 if fused else 0)
