"""Linear layers: one-row GEMV kernels for batch-1 decode on CUDA (with the RMSNorm or
SiLU-and-mul before the GEMM fused in), and oneDNN-packed weights for fp32 on CPU.

At batch 1 on an H200, cuBLAS reads a one-row GEMM's weights at a fraction of the copy
bandwidth, and the norms and activation between the GEMMs are launches of their own: a
Qwen3-0.6B layer's projections took 36.5 us that way, 19.4 us as kernels.gemv's fused launches
(bench/results/decode_gemv_h200.json).

On this project's CPUs oneDNN runs the model's skinny fp32 GEMMs 1.5-4x faster than F.linear
once the weight is stored in oneDNN's own layout (measured: 32 x 576 x 49152 in 5.1 ms instead
of 21.0 ms); its dense-in/dense-out op spares the to_mkldnn/to_dense copies of mkldnn_linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from asyncllm.layers.activation import silu_and_mul
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.quantization import QuantizationConfig
from asyncllm.layers.quantization.base import UnquantizedLinearMethod
from asyncllm.layers.quantization.parameter import weight_param

# rows oneDNN packs the weights for (a decode batch); other row counts run as fast here
_ROWS_HINT = 32


# Every GEMV program re-reads and recomputes the whole normalised or activated input row, which
# pays for the launches it saves on small rows only: per layer, fused against unfused GEMVs,
# Qwen3-0.6B (rows of 1024 and 3072) 19.4 against 21.4 us, Llama-3.1-8B (4096 and 14336) 143.3
# against 115.4 us (bench/results/decode_gemv_h200.json, decode_gemv_llama8b_h200.json).
FUSED_MAX_ROW = 3072


def single_cuda_row(x: torch.Tensor) -> bool:
    """Batch-1 decode on CUDA, the GEMV kernels' case: at 8 rows cuBLAS was as fast as a
    skinny kernel (bench/results/skinny_gemm_h200.json)."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1


class Linear(nn.Linear):
    """nn.Linear whose single CUDA rows go through kernels.gemv."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if single_cuda_row(x):
            return kernels.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class QuantizedLinear(nn.Module):
    """One rank's linear layer run by a quantization method (the linear contract), its output
    made of merged shards (q/k/v or gate/up) that the checkpoint holds apart."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
        params_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.prefix, self.output_sizes = prefix, list(output_sizes)
        self.quant_method = (
            quant_config.get_quant_method(self, prefix)
            if quant_config is not None
            else UnquantizedLinearMethod()
        )
        output_size = sum(output_sizes)
        self.quant_method.create_weights(
            self, input_size, self.output_sizes, input_size, output_size, params_dtype
        )
        self.bias = None
        if bias:
            self.bias = weight_param(torch.empty(output_size, dtype=params_dtype), 0, None)
        self._loaded: set[tuple[str, int]] = set()

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """Copy a checkpoint tensor (one shard of a merged layer when shard_id is set) into
        param, refusing a tensor of the wrong shape with a message naming both."""
        index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id) if shard_id is not None else 0
        name = next(n for n, p in self.named_parameters() if p is param)
        target = param.data
        if getattr(param, "shard_indexed", False):
            target = target[index]
            loaded = loaded.reshape(target.shape) if loaded.numel() == target.numel() else loaded
        elif shard_id is not None and param.output_dim is not None:
            dim, total = param.output_dim, sum(self.output_sizes)
            start = sum(self.output_sizes[:index]) * target.shape[dim] // total
            target = target.narrow(
                dim, start, self.output_sizes[index] * target.shape[dim] // total
            )
        if loaded.shape != target.shape:
            raise ValueError(
                f"{self.prefix}.{name}: the checkpoint's tensor has shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(loaded)
        self._loaded.add((name, index))

    def unloaded(self) -> list[str]:
        """The checkpoint tensors (of which merged shard) that no weight_loader call filled."""
        names = [n for n, _ in self.named_parameters()]
        shards = range(len(self.output_sizes))
        return [
            f"{self.prefix}.{n}[{i}]" for n in names for i in shards if (n, i) not in self._loaded
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def rms_norm_linear(
    norm: RMSNorm, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual), the residual taken as 0 when None; one
    kernel for a single short CUDA row."""
    if isinstance(linear, Linear) and single_cuda_row(x) and x.shape[1] <= FUSED_MAX_ROW:
        return kernels.rms_norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
    if residual is None:
        return linear(norm(x)), x
    x, residual = norm(x, residual)
    return linear(x), residual


def silu_and_mul_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) * up) for x = [gate | up]; one kernel for a single short CUDA row."""
    if isinstance(linear, Linear) and single_cuda_row(x) and x.shape[1] // 2 <= FUSED_MAX_ROW:
        return kernels.silu_and_mul_gemv(x, linear.weight, linear.bias)
    return linear(silu_and_mul(x))


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT))
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # oneDNN keeps memory for every row count it has seen (RSS grew without bound under
        # random request lengths): pad the rows up to one of a few dozen sizes, at most 1/8 more
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        # dense in, dense out: no to_mkldnn / to_dense conversions around the GEMM
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out[:rows]


def padded_rows(rows: int) -> int:
    """rows rounded up to a multiple of 2^(bit_length - 4): 8 sizes per power of two."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


# Row counts past this are left to be built when first met: such a GEMM takes far longer than
# its build (0.7 ms), a server meets few of their sizes, and warming them too took SmolLM2's
# start-up from 4.6 to 5.7 s at a budget of 8,192 tokens (more with larger budgets).
WARM_UP_MAX_ROWS = 2048


@torch.inference_mode()
def warm_up_packed_linears(model: nn.Module, max_rows: int, max_head_rows: int) -> None:
    """Run each PackedLinear shape once at every padded row count it can meet, up to
    WARM_UP_MAX_ROWS (the lm_head sees one row per request sampled). oneDNN builds a kernel per
    shape and row count and keeps it, about 0.6 MiB and 0.7 ms each on SmolLM2's shapes: built
    here, that memory is taken at start-up instead of growing with each new batch size a server
    meets, and no step waits for a build. It adds about 1.4 s to SmolLM2's start-up here."""
    warmed = set()
    for name, module in model.named_modules():
        if not isinstance(module, PackedLinear):
            continue
        limit = min(max_head_rows if name == "lm_head" else max_rows, WARM_UP_MAX_ROWS)
        shape = (module.in_features, module.out_features, module.bias is not None, limit)
        if shape in warmed:
            continue
        warmed.add(shape)
        for rows in sorted({padded_rows(r) for r in range(1, limit + 1)}):
            module(torch.zeros(rows, module.in_features))


def pack_linear_layers(model: nn.Module) -> None:
    """Replace every nn.Linear of a CPU fp32 model by a PackedLinear (a tied lm_head gets its
    own packed copy of the embedding)."""
    if not torch.backends.mkldnn.is_available():
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
