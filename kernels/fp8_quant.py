"""x -> (e4m3 q, fp32 scales) per row, or per row and group of K: the FP8 layers' dynamic
activation quantization as one launch instead of torch's abs, amax, divide, clamp and cast.

Each program owns one row's group: it reads the group once for its absolute maximum and again
(from cache) to divide, clamp and round. Both divisions round to nearest, as torch's do, so q
and the scales equal the torch reference's bit for bit. With a static scale the max pass is
skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


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
    BLOCK: tl.constexpr,
):
    row, group = tl.program_id(0), tl.program_id(1)
    start = group * group_size
    end = tl.minimum(start + group_size, K)
    base = row.to(tl.int64) * K
    offsets = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(start, end, BLOCK):
            k = k0 + offsets
            x = tl.load(x_ptr + base + k, mask=k < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), fp8_max), min_scale)
        tl.store(scale_ptr + row * tl.num_programs(1) + group, scale)
    for k0 in range(start, end, BLOCK):
        k = k0 + offsets
        x = tl.load(x_ptr + base + k, mask=k < end, other=0.0).to(tl.float32)
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
        _quantize_fp8_kernel[(rows, groups)](
            x,
            q,
            scales if static_scale is None else static_scale.float(),
            k,
            group,
            FP8_MAX,
            min_scale,
            STATIC=static_scale is not None,
            BLOCK=min(next_pow2(group), 4096),
            num_warps=4,
        )
    return q, scales
