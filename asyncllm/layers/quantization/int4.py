"""The 4-bit weights every int4 format (AWQ, GPTQ, compressed-tensors pack-quantized) is
repacked to at load, and the GEMM on them.

Runtime layout (kernels.int4_gemm's): qweight int32 [ceil(K / 8), N], value k of column n in
nibble RUNTIME_ORDER.index(k % 8) of qweight[k // 8, n] (values 2j and 2j + 1 at bits 4j and
16 + 4j, which the GEMV widens in pairs), unsigned 0..15; scales and zeros [groups, N] in the
activations' dtype, zeros holding the zero point's whole value, so W[k, n] = (q - zeros) *
scales of group k // group_size. An act-order checkpoint's rows are sorted by group at load and `perm`
reorders the activations' columns to match.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from asyncllm.layers.quantization.base import LinearMethodBase

PACK_FACTOR = 8  # 4-bit values per int32
IN_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)  # nibble i holds value i of the 8
RUNTIME_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the kernels' interleaving of a word's 8 values


def pack_int4(values: torch.Tensor, dim: int, order: tuple[int, ...] = IN_ORDER) -> torch.Tensor:
    """Unsigned 4-bit values packed 8 per int32 along dim (padded with zeros to a multiple of
    8), nibble i (bits 4i..4i+3) holding value order[i] of each 8."""
    v = values.movedim(dim, -1).to(torch.int32)
    v = torch.nn.functional.pad(v, (0, -v.shape[-1] % PACK_FACTOR))
    v = v.reshape(*v.shape[:-1], -1, PACK_FACTOR)
    packed = torch.zeros(v.shape[:-1], dtype=torch.int32, device=v.device)
    for nibble, value in enumerate(order):
        packed |= v[..., value] << (4 * nibble)
    return packed.movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = IN_ORDER) -> torch.Tensor:
    """The inverse of pack_int4 (int32 values 0..15, dim 8 times longer)."""
    shifts = torch.tensor([4 * order.index(v) for v in range(PACK_FACTOR)], device=packed.device)
    p = packed.movedim(dim, -1).unsqueeze(-1)
    values = ((p >> shifts.to(torch.int32)) & 0xF).flatten(-2)
    return values.movedim(-1, dim)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, k: int
) -> torch.Tensor:
    """W [K, N] in fp32 from the runtime layout."""
    q = unpack_int4(qweight, 0, RUNTIME_ORDER)[:k].float()
    groups = torch.arange(k, device=q.device) // group_size
    return (q - zeros.float()[groups]) * scales.float()[groups]


def set_int4_weights(
    layer: nn.Module,
    replaced: tuple[str, ...],
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> None:
    """Store unpacked values q [K, N] (0..15), scales and zeros [groups, N] on layer in the
    runtime layout, in place of the checkpoint's parameters named in replaced; g_idx [K] is
    each row's group (act-order), None when row k is in group k // group_size."""
    perm = None if g_idx is None else _act_order_perm(g_idx.long(), group_size)
    if perm is not None:
        q = q[perm]
    for name in replaced:
        delattr(layer, name)
    layer.register_parameter(
        "qweight", nn.Parameter(pack_int4(q, 0, RUNTIME_ORDER), requires_grad=False)
    )
    layer.register_parameter("scales", nn.Parameter(scales.contiguous(), requires_grad=False))
    zeros = nn.Parameter(zeros.to(scales.dtype).contiguous(), requires_grad=False)
    layer.register_parameter("zeros", zeros)
    layer.register_buffer("perm", perm)
    layer.int4_group_size, layer.int4_in_features = group_size, q.shape[0]


def _act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The row order that sorts rows by group (None when they already are); each group must
    hold group_size rows, as GPTQ's act-order writes them."""
    k = g_idx.shape[0]
    expected = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, expected):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], expected):
        raise ValueError(f"g_idx does not split the {k} input rows into groups of {group_size}")
    return perm


class Int4LinearMethod(LinearMethodBase):
    """A 4-bit format's method: its process_weights_after_loading calls set_int4_weights."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:
            rows = rows[:, layer.perm]
        if rows.is_cuda:
            out = kernels.int4_gemm(
                rows, layer.qweight, layer.scales, layer.zeros, layer.int4_group_size
            )
        else:
            weight = dequantize_int4(
                layer.qweight,
                layer.scales,
                layer.zeros,
                layer.int4_group_size,
                layer.int4_in_features,
            )
            out = (rows.float() @ weight).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def check_int4_shapes(method: str, in_features: int, out_sizes: list[int], group_size: int) -> None:
    """ValueError unless K splits into groups and every output shard into packed words."""
    if in_features % group_size or group_size % PACK_FACTOR:
        raise ValueError(
            f"{method}: {in_features} input features do not split into groups of {group_size} "
            f"(a multiple of {PACK_FACTOR})"
        )
    if any(size % PACK_FACTOR for size in out_sizes):
        raise ValueError(f"{method}: output sizes {out_sizes} are not multiples of {PACK_FACTOR}")
