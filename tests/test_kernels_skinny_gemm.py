"""The skinny GEMM kernel against x.float() @ w.float().T, and the Linear that dispatches to it.

On CPU under TRITON_INTERPRET=1 (set in conftest.py) in fp32 and fp16 on small awkward shapes;
with a GPU also in bf16 on the Qwen3-0.6B and Llama-3.1-8B decode shapes.
"""

from __future__ import annotations

import pytest
import torch
import triton

import asyncllm.models.layers.linear as linear_module
from kernels import skinny_gemm
from kernels.skinny_gemm import SkinnyGemmConfig, choose_skinny_config

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# fp32 only reorders the sum; 16-bit outputs add one rounding (half an ulp) at the store
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (N, K) of each GEMM of a decode step: qkv_proj, o_proj, gate_up_proj, down_proj, lm_head
QWEN3_0_6B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
LLAMA_3_1_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def random_gemm(
    m: int, n: int, k: int, dtype: torch.dtype, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inputs scaled so every output is about N(0, 1) whatever K is."""
    gen = torch.Generator(DEVICE).manual_seed(m * n + k)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)

    return rand(m, k), rand(n, k, scale=k**-0.5), rand(n) if bias else None


def assert_matches_reference(
    out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> None:
    expected = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    assert out.dtype == x.dtype and out.shape == expected.shape
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "m, n, k", [(1, 1, 64), (3, 17, 96), (8, 1000, 1000), (1, 4099, 2048), (8, 17, 2048)]
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_gemm_matches_torch(m: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    x, w, b = random_gemm(m, n, k, dtype, bias)
    assert_matches_reference(skinny_gemm(x, w, b), x, w, b)


@pytest.mark.parametrize("split_k, k_per_split", [(1, 1024), (3, 384), (8, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_only_changes_speed(split_k: int, k_per_split: int, bias: bool) -> None:
    x, w, b = random_gemm(3, 40, 1000, torch.float32, bias)
    config = SkinnyGemmConfig(block_n=16, block_k=128, split_k=split_k, k_per_split=k_per_split)
    assert_matches_reference(skinny_gemm(x, w, b, config), x, w, b)


def test_rows_of_x_may_be_strided() -> None:
    x, w, b = random_gemm(4, 33, 96, torch.float32, True)
    wide = torch.zeros(4, 200, device=DEVICE)
    wide[:, 50:146] = x
    assert_matches_reference(skinny_gemm(wide[:, 50:146], w, b), x, w, b)


@pytest.mark.parametrize("n, k", QWEN3_0_6B + LLAMA_3_1_8B)
def test_config_fills_an_h200_and_covers_k(n: int, k: int) -> None:
    sms = 132
    config = choose_skinny_config(n, k, element_size=2, sms=sms)
    assert triton.cdiv(n, config.block_n) * config.split_k >= sms
    assert config.k_per_split % config.block_k == 0
    assert (config.split_k - 1) * config.k_per_split < k <= config.split_k * config.k_per_split


def test_k_is_split_only_when_row_tiles_leave_sms_idle() -> None:
    assert choose_skinny_config(1024, 2048, element_size=2, sms=132).split_k > 1
    assert choose_skinny_config(151936, 1024, element_size=2, sms=132).split_k == 1


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("n, k", QWEN3_0_6B + LLAMA_3_1_8B)
@pytest.mark.parametrize("m", [1, 8])
def test_skinny_gemm_matches_torch_on_model_shapes_in_bf16(m: int, n: int, k: int) -> None:
    x, w, b = random_gemm(m, n, k, torch.bfloat16, bias=False)
    assert_matches_reference(skinny_gemm(x, w, b), x, w, b)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("extra_rows", [0, 1])
def test_linear_takes_the_skinny_kernel_up_to_its_row_limit(
    extra_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, skinny = linear_module.SKINNY_MAX_ROWS + extra_rows, extra_rows == 0
    calls = []

    def counted_skinny_gemm(*args: torch.Tensor | None) -> torch.Tensor:
        calls.append(args)
        return skinny_gemm(*args)

    monkeypatch.setattr(linear_module, "skinny_gemm", counted_skinny_gemm)
    torch.manual_seed(0)
    linear = linear_module.Linear(256, 384, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(rows, 256, device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert_matches_reference(linear(x), x, linear.weight, linear.bias)
    assert bool(calls) == skinny
