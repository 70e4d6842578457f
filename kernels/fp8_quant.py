"""x -> (e4m3 q, fp32 scales) per row, or per row and group of K: the FP8 layers' dynamic
activation quantization as one launch instead of torch's abs, amax, divide, clamp and cast.

Each program owns one row's group. A group of up to 16K values (Llama's 14,336-wide down_proj
input included) is held in registers, 32 a thread, and read once: the loop over 4K-wide blocks
that reads it twice, for the max and to divide, is two chains of dependent DRAM round trips
(at 128 rows of 14,336 on the H200 the loop took 8.9 us, one read 5.2). From 1,024 rows on,
groups wider than 4K take the loop on 4 warps again: there the 16-warp programs, fewer of them
resident, lost (45 against 43 us at 2,048 rows, 163 against 132 at 8,192;
bench/results/quantize_fp8_variants_h200.json). The loop's second read mostly hits cache.
Both divisions round to nearest, as torch's do, so q and the scales equal the torch
reference's bit for bit. With a static scale the max is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
# the widest group read once, and the values a thread holds of it
_ONE_READ_MAX = 16384
_VALUES_PER_THREAD = 32
# groups wider than the loop's block are read once only up to this many rows (see above)
_LOOP_BLOCK = 4096
_ONE_READ_MAX_WIDE_ROWS = 1024


@triton.jit
def _quantize_fp8_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    group_size,
    fp8_max,
    min_scale,
    STATIC: tl.constexpr,
    ONE_READ: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, group = tl.program_id(0), tl.program_id(1)
    start = group * group_size
    end = tl.minimum(start + group_size, K)
    base = row.to(tl.int64) * K
    offsets = tl.arange(0, BLOCK)
    if ONE_READ:
        k = start + offsets
        x = tl.load(x_ptr + base + k, mask=k < end, other=0.0).to(tl.float32)
        scale = group_scale(x, scale_ptr, row, group, fp8_max, min_scale, STATIC)
        store_quantized(q_ptr, base, k, end, x, scale, fp8_max)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        if not STATIC:
            for k0 in range(start, end, BLOCK):
                k = k0 + offsets
                x = tl.load(x_ptr + base + k, mask=k < end, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
        scale = group_scale(amax, scale_ptr, row, group, fp8_max, min_scale, STATIC)
        for k0 in range(start, end, BLOCK):
            k = k0 + offsets
            x = tl.load(x_ptr + base + k, mask=k < end, other=0.0).to(tl.float32)
            store_quantized(q_ptr, base, k, end, x, scale, fp8_max)


def one_read_warps(block: int) -> int:
    """Warps for a program holding a block of values, _VALUES_PER_THREAD a thread: 4 at least,
    as before for groups of 4K and less (the block-wise 128s included), at most 16."""
    return min(max(block // (32 * _VALUES_PER_THREAD), 4), 16)


@triton.jit
def group_scale(x, scale_ptr, row, group, fp8_max, min_scale, STATIC: tl.constexpr):
    """The static scale, or the group's max |x| over fp8_max (at least min_scale), stored."""
    if STATIC:
        return tl.load(scale_ptr)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), fp8_max), min_scale)
    tl.store(scale_ptr + row * tl.num_programs(1) + group, scale)
    return scale


@triton.jit
def store_quantized(q_ptr, base, k, end, x, scale, fp8_max):
    q = tl.clamp(tl.math.div_rn(x, scale), -fp8_max, fp8_max)
    tl.store(q_ptr + base + k, q.to(q_ptr.dtype.element_ty), mask=k < end)


def quantize_fp8(
    x: torch.Tensor,
    group_size: int | None = None,
    static_scale: torch.Tensor | None = None,
    min_scale: float = 1e-12,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scales [M, ceil(K / group_size)] fp32) with x ~ q * scale,
    each group's absolute max mapped to the e4m3 max (scale at least min_scale); group_size
    None: one group per row. static_scale (one fp32 value): q = x / static_scale, and the
    scales returned are it for every row."""
    x = x.contiguous()
    rows, k = x.shape
    group = group_size or k
    groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    if static_scale is not None:
        assert group_size is None and static_scale.numel() == 1
        scales = static_scale.reshape(1, 1).float().expand(rows, 1).contiguous()
    else:
        scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        block = next_pow2(group)
        one_read = block <= _LOOP_BLOCK or (
            block <= _ONE_READ_MAX and rows <= _ONE_READ_MAX_WIDE_ROWS
        )
        block = block if one_read else _LOOP_BLOCK
        num_warps = one_read_warps(block)
        _quantize_fp8_kernel[(rows, groups)](
            x,
            q,
            scales if static_scale is None else static_scale.float(),
            k,
            group,
            FP8_MAX,
            min_scale,
            STATIC=static_scale is not None,
            ONE_READ=one_read,
            BLOCK=block,
            num_warps=num_warps,
        )
    return q, scales
