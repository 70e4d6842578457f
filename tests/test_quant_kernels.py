"""The 4-bit and FP8 GEMM kernels against their torch references.

On CPU under TRITON_INTERPRET=1 (set in conftest.py) on small awkward shapes: N and K off the
tiles, K not a multiple of the group, rows on both sides of the GEMV/GEMM switch; with a GPU
also in bf16 on a Llama-3.1-8B projection.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import kernels
from asyncllm.layers.quantization.fp8 import (
    MIN_SCALE,
    dequantize_blocks,
    quantize_per_row,
    quantize_per_token_group,
    quantize_with_scale,
)
from asyncllm.layers.quantization.int4 import RUNTIME_ORDER, dequantize_int4, pack_int4
from kernels._common import configs_by_shape, next_pow2
from kernels.fp8_gemm import ROWWISE_BY_SHAPE, Fp8GemmConfig
from kernels.gemv_kernels import GemvConfig, fp8_gemv_config
from kernels.int4_kernels import (
    GEMV_BY_SHAPE,
    GEMV_CONFIG,
    GEMV_MAX_ROWS,
    GEMV_ROWS_CONFIG,
    HALF_MAGIC_BITS,
    PAIR_MASK,
    Int4GemvConfig,
    gemv_config_for,
    int4_n_major,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def int4_weights(k: int, n: int, group: int, dtype: torch.dtype, seed: int, n_major=False):
    """qweight, scales, zeros; n_major: stored column by column (kernels.int4_n_major)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    groups = -(-k // group)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(dtype)
    tensors = (pack_int4(q, 0, RUNTIME_ORDER), scales, zeros)
    return tuple((int4_n_major(t) if n_major else t).to(DEVICE) for t in tensors)


# (M, K, N, group): GEMV rows (1-4) and GEMM rows (5, 37), K ending mid-group and mid-word;
# GEMV tiles inside one group (group 256 at 2 rows, 128 at 3) and across groups, K split, and
# K not split for N wide enough to fill the GPU alone
INT4_CASES = [
    (1, 64, 40, 16),
    (3, 200, 72, 40),
    (5, 96, 130, 32),
    (37, 136, 24, 8),
    (4, 1032, 8, 1032),
    (2, 600, 80, 256),
    (2, 4096, 64, 128),
    (3, 1024, 64, 128),
    (1, 520, 1040, 8),
]


@pytest.mark.parametrize(("m", "k", "n", "group"), INT4_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_major", [False, True])
def test_int4_gemm_matches_dequantized_weights(m, k, n, group, dtype, n_major) -> None:
    qweight, scales, zeros = int4_weights(k, n, group, dtype, seed=m + k + n, n_major=n_major)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    expected = x.float() @ dequantize_int4(qweight, scales, zeros, group, k)
    out = kernels.int4_gemm(x, qweight, scales, zeros, group)
    assert out.dtype == dtype and out.shape == (m, n)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not CUDA, reason="the packed bf16 path runs only on the GPU")
@pytest.mark.parametrize(("m", "k", "n", "group"), [c for c in INT4_CASES if c[0] <= GEMV_MAX_ROWS])
def test_int4_gemv_bf16_pairs_on_awkward_sizes(m, k, n, group) -> None:
    qweight, scales, zeros = int4_weights(k, n, group, torch.bfloat16, seed=m + k + n)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(qweight, scales, zeros, group, k)
    out = kernels.int4_gemm(x, qweight, scales, zeros, group).float()
    assert (out - expected).abs().max() <= 1e-2 * expected.abs().max()


@pytest.mark.parametrize(("m", "k", "n", "config"), [
    (1, 256, 96, Int4GemvConfig(block_n=32, block_r=8, splits=1)),  # whole tiles, one part
    (3, 264, 40, Int4GemvConfig(block_n=16, block_r=4, splits=2)),  # N and K off the tiles
])  # fmt: skip
def test_int4_gemv_launch_settings(m, k, n, config) -> None:
    qweight, scales, zeros = int4_weights(k, n, 8, torch.float32, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    expected = x @ dequantize_int4(qweight, scales, zeros, 8, k)
    out = kernels.int4_gemm(x, qweight, scales, zeros, 8, gemv_config=config)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# tiles of several slices: slices in different groups (a group of one word, of 5 words cut to
# slices of 1, of 8 words two slices a tile), K and N ending mid-tile, a tile's last slice wholly
# past K, K split in two, and whole tiles (EVEN)
@pytest.mark.parametrize(("m", "k", "n", "group", "config"), [
    (1, 200, 40, 8, Int4GemvConfig(block_n=16, block_r=4, slices=4, splits=1)),
    (2, 520, 20, 64, Int4GemvConfig(block_n=8, block_r=8, slices=2, splits=1)),
    (3, 1000, 48, 40, Int4GemvConfig(block_n=16, block_r=8, slices=8, splits=2)),
    (4, 128, 16, 128, Int4GemvConfig(block_n=16, block_r=16, slices=2, splits=1)),
    (1, 1024, 64, 128, Int4GemvConfig(block_n=32, block_r=16, slices=4, splits=1)),
    (1, 4096, 32, 128, Int4GemvConfig(block_n=16, block_r=16, slices=8, splits=1, num_warps=8)),
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_major", [False, True])
def test_int4_gemv_tiles_of_several_slices(m, k, n, group, config, dtype, n_major) -> None:
    """bf16 takes the packed path on the GPU (the fp32 one on the CPU)."""
    qweight, scales, zeros = int4_weights(k, n, group, dtype, seed=k + n, n_major=n_major)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEVICE)
    expected = x.float() @ dequantize_int4(qweight, scales, zeros, group, k)
    out = kernels.int4_gemm(x, qweight, scales, zeros, group, gemv_config=config)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    else:  # the packed path's bound, as test_int4_gemv_bf16_pairs_on_awkward_sizes states it
        assert (out.float() - expected).abs().max() <= 1e-2 * expected.abs().max()


def test_launch_settings_come_from_the_environment(monkeypatch) -> None:
    """A sweep's winners per projection shape run in the same session through the environment:
    the int4 GEMV's at one row (the 2-4 row settings stay), the FP8 GEMV's, the row-wise FP8
    GEMM's up to its rows."""
    winner = Int4GemvConfig(block_n=8, block_r=4, slices=2, splits=1, num_warps=2)
    monkeypatch.setenv("ASYNCLLM_INT4_GEMV", json.dumps({"4096x14336": dataclasses.asdict(winner)}))
    fp8 = GemvConfig(block_n=8, block_k=2048, num_warps=4)
    monkeypatch.setenv("ASYNCLLM_FP8_GEMV", json.dumps({"4096x4096": dataclasses.asdict(fp8)}))
    tiles = Fp8GemmConfig(block_m=64, block_n=64, max_rows=256)
    by_shape = {"4096x4096": dataclasses.asdict(tiles), "4096x1000": dataclasses.asdict(tiles)}
    monkeypatch.setenv("ASYNCLLM_FP8_GEMM", json.dumps(by_shape))
    configs_by_shape.cache_clear()
    try:
        assert gemv_config_for(1, 4096, 14336) == winner
        assert gemv_config_for(1, 4096, 4096) == GEMV_CONFIG
        assert gemv_config_for(3, 4096, 14336) == GEMV_ROWS_CONFIG
        assert fp8_gemv_config(4096, 4096) == fp8
        assert fp8_gemv_config(6144, 4096) == GemvConfig(block_n=4, block_k=2048)  # the rule
        assert kernels.fp8_rowwise_wins(256, 4096, 4096)
        assert not kernels.fp8_rowwise_wins(257, 4096, 4096)
        assert not kernels.fp8_rowwise_wins(256, 6144, 4096)
        assert kernels.fp8_rowwise_wins(64, 4096, 1000)  # K off the 128-wide tiles
    finally:
        for name in ("ASYNCLLM_INT4_GEMV", "ASYNCLLM_FP8_GEMV", "ASYNCLLM_FP8_GEMM"):
            monkeypatch.delenv(name)
        configs_by_shape.cache_clear()
    assert gemv_config_for(1, 4096, 14336) == GEMV_BY_SHAPE.get((4096, 14336), GEMV_CONFIG)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_half_path_unpacks_pairs_exactly(dtype) -> None:
    """The GEMV's PTX path, step by step in torch: word >> 4j masked with PAIR_MASK and OR-ed
    into the magic pair reads as the halves (magic + q) of values 2j and 2j + 1 of the
    runtime layout; less magic + z (a whole zero point) that is q - z exactly, and the packed
    products summed per word match the dequantized weights."""
    k, n, group = 64, 24, 32
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 17, (k // group, n), generator=gen).to(dtype)
    words = pack_int4(q, 0, RUNTIME_ORDER)  # [k / 8, n]
    magic = torch.tensor([HALF_MAGIC_BITS[dtype]], dtype=torch.int32).view(dtype)[0]
    z = zeros.repeat_interleave(group // 8, 0)  # each word's zero points
    for j in range(4):
        halves = (((words >> (4 * j)) & PAIR_MASK) | HALF_MAGIC_BITS[dtype]).view(dtype)
        pairs = halves.view(k // 8, n, 2) - (magic + z)[..., None]  # rounded to dtype
        expected = torch.stack([q[2 * j :: 8], q[2 * j + 1 :: 8]], -1) - z.float()[..., None]
        assert torch.equal(pairs.float(), expected)
    x = torch.randn(k, generator=gen).to(dtype)
    scales = torch.rand(k // group, n, generator=gen).to(dtype)
    # each half lane (values 0, 2, 4, 6 and 1, 3, 5, 7 of a word) sums its 4 products in
    # dtype, one rounding a step as the packed FMAs do; the two lanes add in fp32
    deq = (q.float() - zeros.float().repeat_interleave(group, 0)).to(dtype).view(k // 8, 8, n)
    xs = x.view(k // 8, 8, 1)
    lanes = [(xs[:, i] * deq[:, i]).to(dtype) for i in range(2)]
    for i in range(2, 8):
        lanes[i % 2] = (lanes[i % 2].float() + xs[:, i].float() * deq[:, i].float()).to(dtype)
    word_sums = lanes[0].float() + lanes[1].float()
    out = (word_sums * scales.float().repeat_interleave(group // 8, 0)).sum(0)
    reference = x.float() @ dequantize_int4(words, scales, zeros, group, k)
    assert (out - reference).abs().max() <= 1e-2 * reference.abs().max()


# compiles the GEMV for sm_90 without a GPU (the interpreter's kernels cannot be compiled)
_ASSEMBLE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kernels.int4_kernels import _int4_gemv_kernel
half, rows, even, slices = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
ty = "*bf16" if half == 1 else "*fp16"
signature = {"x_ptr": "*i32", "qw_ptr": "*i32", "s_ptr": ty, "z_ptr": ty, "out_ptr": "*fp32",
             "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_wr": "i32",
             "stride_wn": "i32", "stride_sg": "i32", "stride_sn": "i32"}
constexprs = {"GROUP_SIZE": 128, "BLOCK_M": rows, "BLOCK_N": 64, "BLOCK_R": 16,
              "SLICES": slices, "SPLIT_K": True, "EVEN": even, "HALF": half, "USE_PDL": True}
signature.update(dict.fromkeys(constexprs, "constexpr"))
source = ASTSource(_int4_gemv_kernel, signature, constexprs)
try:
    binary = compile(source, target=GPUTarget("cuda", 90, 32))
except RuntimeError as error:  # no ptxas in this triton install
    print("skip", error)
    sys.exit(0)
print("ok", binary.asm["ptx"].count("fma.rn."))
"""


@pytest.mark.parametrize(("half", "rows", "even", "slices"), [(1, 1, True, 8), (2, 4, False, 1)])
def test_int4_half_path_assembles_for_hopper(half, rows, even, slices) -> None:
    """The inline PTX (which the interpreter cannot run) goes through ptxas for sm_90, its
    packed FMAs (3 a word) in the kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-c", _ASSEMBLE, str(half), str(rows), str(int(even)), str(slices)]
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, check=True)
    status, detail = run.stdout.split(maxsplit=1)
    if status == "skip":
        pytest.skip(f"cannot assemble for sm_90 here: {detail}")
    assert int(detail) >= 3


def test_both_int4_paths_are_covered() -> None:
    assert any(c[0] <= GEMV_MAX_ROWS for c in INT4_CASES)
    assert any(c[0] > GEMV_MAX_ROWS for c in INT4_CASES)


def test_int4_group_size_must_be_a_multiple_of_eight() -> None:
    qweight, scales, zeros = int4_weights(24, 8, 12, torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.int4_gemm(torch.ones(1, 24, device=DEVICE), qweight, scales, zeros, 12)


# (M, N, K, block): partial blocks in N and K, rows below and above one tile
FP8_CASES = [
    (1, 48, 64, (16, 32)),
    (7, 40, 100, (16, 32)),
    (70, 130, 256, (128, 128)),
    (3, 200, 160, (64, 64)),
]


@pytest.mark.parametrize(("m", "n", "k", "block"), FP8_CASES)
def test_fp8_block_gemm_matches_dequantized_operands(m, n, k, block) -> None:
    gen = torch.Generator().manual_seed(m + n)
    wq = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    w_scale = (torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 0.01).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    xq, x_scale = quantize_per_token_group(x, block[1])
    expected = (
        dequantize_blocks(xq, x_scale, (1, block[1])) @ dequantize_blocks(wq, w_scale, block).t()
    )
    out = kernels.fp8_block_gemm(xq, x_scale, wq, w_scale, block, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# (M, N, K, config): rows, columns and K off every tile, K not a power of two, one tile
@pytest.mark.parametrize(("m", "n", "k", "config"), [
    (1, 48, 64, Fp8GemmConfig(block_m=16, block_n=32, block_k=32)),
    (7, 40, 100, Fp8GemmConfig(block_m=16, block_n=32, block_k=32)),
    (70, 130, 200, Fp8GemmConfig(block_m=32, block_n=64, block_k=64)),
    (130, 72, 1000, Fp8GemmConfig()),
])  # fmt: skip
def test_fp8_rowwise_gemm_matches_dequantized_operands(m, n, k, config) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    wq, w_scale = quantize_per_row(torch.randn(n, k, generator=gen))
    xq, x_scale = quantize_per_row(torch.randn(m, k, generator=gen) * 3)
    expected = (xq.float() * x_scale) @ (wq.float() * w_scale).t()
    xq, x_scale, wq, w_scale = (t.to(DEVICE) for t in (xq, x_scale, wq, w_scale.view(1, -1)))
    out = kernels.fp8_rowwise_gemm(xq, x_scale, wq, w_scale, torch.float32, config)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_fp8_rowwise_gemm_is_off_until_measured() -> None:
    """The layer keeps torch._scaled_mm until a GPU sweep says where the kernel wins."""
    assert ROWWISE_BY_SHAPE == {}
    assert not kernels.fp8_rowwise_wins(64, 4096, 4096)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 256])
def test_int4_gemm_bf16_on_a_llama_8b_projection(m: int) -> None:
    k, n, group = 4096, 6144, 128
    qweight, scales, zeros = int4_weights(k, n, group, torch.bfloat16, seed=m)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(qweight, scales, zeros, group, k)
    out = kernels.int4_gemm(x, qweight, scales, zeros, group).float()
    assert (out - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize(("n", "k"), [(17, 96), (1000, 1000), (33, 5000)])
@pytest.mark.parametrize("programs_per_sm", [0, 2])
def test_gemv_reads_fp8_weights(n: int, k: int, programs_per_sm: int) -> None:
    """The FP8 layers' batch-1 path: one row of 16/32-bit x against e4m3 W (four rows of W a
    program, N off that, or programs taking row blocks in turn), each column scaled in the
    kernel."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    x = (torch.randn(1, k, generator=gen) * k**-0.5).to(DEVICE)
    scale = (torch.rand(1, n, generator=gen) + 0.5).to(DEVICE)
    # the default settings, or programs taking row blocks in turn over K in one tile
    config = None
    if programs_per_sm:
        config = GemvConfig(4, next_pow2(k), programs_per_sm=programs_per_sm)
    unscaled = kernels.gemv(x, w, None, config)
    torch.testing.assert_close(unscaled, x @ w.float().t(), rtol=1e-4, atol=1e-4)
    expected = (x @ w.float().t()) * scale
    out = kernels.gemv(x, w, None, config, scale=scale)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# (M, K, group): one group per row read once (awkward widths), a row too long for one read
# (read in 4K blocks, the last partial), groups with a partial last one
QUANT_CASES = [(3, 100, None), (2, 5000, None), (2, 20000, None), (5, 300, 128), (1, 40, 16)]


@pytest.mark.parametrize(("m", "k", "group"), QUANT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_equals_the_torch_reference(m, k, group, dtype) -> None:
    """Bit for bit, an all-zero row (scale MIN_SCALE) included. On the GPU random values over
    six decades, into e4m3's subnormals; the interpreter's cast to e4m3 rounds wrongly (124.1 to
    64, 0.0038 to 0.00195), so on CPU the values are e4m3 values times 1/8 with each group's
    max at 448/8: the scale comes out 1/8 and x / scale needs no rounding."""
    gen = torch.Generator().manual_seed(m * k)
    if CUDA:
        magnitudes = (torch.rand(m, k, generator=gen) + 1) * torch.logspace(-3, 3, k)
        x = magnitudes * (torch.randint(0, 2, (m, k), generator=gen) * 2 - 1)
    else:
        x = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn).float() / 8
        x[:, :: group or k] = -448 / 8
    x = x.to(dtype)
    x[0] = 0.0
    x = x.to(DEVICE)
    q, scales = kernels.quantize_fp8(x, group, min_scale=MIN_SCALE)
    q_ref, scales_ref = quantize_per_row(x) if group is None else quantize_per_token_group(x, group)
    assert torch.equal(scales, scales_ref.view(m, -1))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_quantize_fp8_loops_over_wide_rows_of_many_row_batches(monkeypatch) -> None:
    """Past _ONE_READ_MAX_WIDE_ROWS rows (here 2) a row wider than 4K is looped over, with
    the same result."""
    import kernels.fp8_quant as fp8_quant

    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1))
    x = (x.to(torch.float8_e4m3fn).float() / 8).to(DEVICE)
    once = kernels.quantize_fp8(x, min_scale=MIN_SCALE)
    monkeypatch.setattr(fp8_quant, "_ONE_READ_MAX_WIDE_ROWS", 2)
    looped = kernels.quantize_fp8(x, min_scale=MIN_SCALE)
    assert torch.equal(once[1], looped[1])
    assert torch.equal(once[0].view(torch.uint8), looped[0].view(torch.uint8))


@pytest.mark.parametrize("k", [70, 20000])
def test_quantize_fp8_with_a_static_scale(k) -> None:
    """e4m3 values times the scale (exact under the interpreter too, see above), and values
    past 448 times it, which clamp; in one read and in 16K blocks."""
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(0)) * 100
    x = x.to(torch.float8_e4m3fn).float() / 2
    x[:, ::9] = torch.tensor([500.0, -2000.0]).repeat(4, 1 + k // 18)[:, : len(range(0, k, 9))]
    x = x.to(DEVICE)
    static = torch.tensor([0.5], device=DEVICE)
    q, scales = kernels.quantize_fp8(x, static_scale=static)
    ref_scales = static.expand(4, 1)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(q.view(torch.uint8), quantize_with_scale(x, ref_scales).view(torch.uint8))


def exact_fp8_rows(k: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose values the interpreter quantizes exactly (see above), the first all zero."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(torch.float8_e4m3fn)
    x = (x.float() / 8).to(dtype)
    x[0] = 0.0
    return x.to(DEVICE)


@pytest.mark.parametrize("k", [7, 100, 576, 4096])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_the_norm_then_quantize_fp8(k, rows, dtype, with_residual) -> None:
    """One launch gives what the norm's kernel and then quantize_fp8 give: the summed residual,
    and for 16-bit activations (the engine's) the FP8 rows and their scales bit for bit (an
    all-zero row's MIN_SCALE), and under the interpreter for float32 ones too; x is left as it
    was. On the GPU the two kernels' float32 sums of squares may differ in their last bit (each
    compiles its reduction), which a scale keeps and a value moves by at most one e4m3 step."""
    x = exact_fp8_rows(k, rows, dtype)
    residual = exact_fp8_rows(k, rows, dtype).flip(0).contiguous() if with_residual else None
    weight = (torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEVICE)
    x_before = x.clone()
    fused_residual = residual.clone() if with_residual else None
    q, scales = kernels.rms_norm_fp8(x, fused_residual, weight, 1e-6, MIN_SCALE)
    if with_residual:
        normed, summed = kernels.fused_add_rms_norm(x.clone(), residual, weight, 1e-6)
        assert torch.equal(fused_residual, summed)
    else:
        normed = kernels.rms_norm(x, weight, 1e-6)
    q_ref, scales_ref = kernels.quantize_fp8(normed, min_scale=MIN_SCALE)
    assert torch.equal(x, x_before)
    assert scales.shape == (rows, 1)
    if not with_residual:
        assert scales[0].item() == torch.tensor(MIN_SCALE).item()
    if CUDA and dtype == torch.float32:
        torch.testing.assert_close(scales, scales_ref, rtol=1e-6, atol=0)
        ours, theirs = q.float() * scales, q_ref.float() * scales_ref
        assert ((ours - theirs).abs() <= theirs.abs() / 8 + scales_ref * 2**-9).all()
    else:
        assert torch.equal(scales, scales_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("n", [5, 96, 1000, 14336])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantize_fp8(n, dtype) -> None:
    """Bit for bit, one program a row up to Llama-3.1-8B's 14,336-wide intermediate size; an
    all-zero row's scale is MIN_SCALE."""
    x = exact_fp8_rows(2 * n, 3, dtype)
    q, scales = kernels.silu_and_mul_fp8(x, MIN_SCALE)
    q_ref, scales_ref = kernels.quantize_fp8(kernels.silu_and_mul(x), min_scale=MIN_SCALE)
    assert scales.shape == (3, 1) and torch.equal(scales, scales_ref)
    assert scales[0].item() == torch.tensor(MIN_SCALE).item()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
