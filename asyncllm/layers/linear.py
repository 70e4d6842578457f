"""Linear layers split across tensor-parallel ranks (vLLM's names and shapes), each holding a
quant_method that stores its weights and runs its GEMM (layers/quantization/base.py).

Column-parallel layers split the output features (each rank computes its slice), row-parallel
ones the input features (each rank computes a partial sum, all-reduced). A layer's
weight_loader(param, loaded_weight, shard_id) copies this rank's part of a checkpoint tensor into
param, reading from a safetensors slice only the rows or columns the rank keeps.

On CUDA the RMSNorm before a GEMM and the SiLU-and-mul before the down projection fuse into
one GEMV launch for a single row: a Qwen3-0.6B layer's projections took 36.5 us as cuBLAS
GEMMs with separate norms, 19.4 us fused (bench/results/decode_gemv_h200.json).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

import kernels
from asyncllm.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from asyncllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from asyncllm.layers.activation import silu_and_mul
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.quantization.base import (
    LinearMethodBase,
    UnquantizedLinearMethod,
    padded_rows,
    single_cuda_row,
)
from asyncllm.layers.quantization.fp8 import MIN_SCALE
from kernels.cpu_gemm import cpu_gemm_silu_and_mul

# a checkpoint tensor as the loader hands it over: a torch.Tensor, or a safetensors slice that
# reads from the file only what is indexed
LoadedWeight = Any

# Every GEMV program re-reads and recomputes the whole normalised or activated input row, which
# pays for the launches it saves on small rows only: per layer, fused against unfused GEMVs,
# Qwen3-0.6B (rows of 1024 and 3072) 19.4 against 21.4 us, Llama-3.1-8B (4096 and 14336) 143.3
# against 115.4 us (bench/results/decode_gemv_h200.json, decode_gemv_llama8b_h200.json).
FUSED_MAX_ROW = 3072


class QuantizationConfig(Protocol):
    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for the layer named prefix; None leaves it unquantized."""
        ...


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) cannot be split evenly across {denominator} tensor-parallel "
            "ranks: choose a tensor_parallel_size that divides it."
        )
    return numerator // denominator


def loaded_shape(loaded: LoadedWeight) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_all(loaded: LoadedWeight) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


def read_range(loaded: LoadedWeight, dim: int, start: int, size: int) -> torch.Tensor:
    """loaded[start : start + size] along dim, read from the file only that far."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def copy_weight(target: torch.Tensor, source: torch.Tensor, name: str = "a parameter") -> None:
    """copy_ without its broadcasting, which would hide a checkpoint of the wrong shape."""
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(
            f"{name}: the checkpoint tensor of shape {tuple(source.shape)} does not fit the "
            f"parameter (or its shard) of shape {tuple(target.shape)}"
        )
    target.copy_(source)


def default_weight_loader(param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
    copy_weight(param.data, read_all(loaded))


class LinearBase(nn.Module):
    """forward: combine(quant_method.apply(x, rank_bias)); subclasses say what this rank holds,
    what bias it adds and how the ranks' outputs combine."""

    # True where the consumer reads the output in a packed CPU weight's own dtype (the bf16
    # mode's gate_up, into silu_and_mul; o_proj and down_proj, into the fused add-norms): no
    # float32 copy of it is made
    keeps_weight_dtype = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias_sharded: bool,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size, self.prefix = input_size, output_size, prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.output_size_per_partition = sum(output_partition_sizes)
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            torch.get_default_dtype(),
        )
        if bias:
            size = self.output_size_per_partition if bias_sharded else output_size
            self.bias = nn.Parameter(torch.empty(size), requires_grad=False)
            self.bias.output_dim = 0 if bias_sharded else None
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
        self._loaded_shards: set[tuple[str, int]] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(self.quant_method.apply(self, x, self.rank_bias))

    def forward_fp8(
        self, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """forward for x already quantized per row, where quant_method.takes_fp8_rows(x)."""
        return self.combine(self.quant_method.apply_fp8(self, xq, x_scale, dtype, self.rank_bias))

    @property
    def rank_bias(self) -> torch.Tensor | None:
        return self.bias

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        self.load_unsplit(param, loaded_weight, 0)

    def load_unsplit(self, param: nn.Parameter, loaded: LoadedWeight, shard_index: int) -> None:
        """A param not split across ranks: whole, or, when shard_indexed, one value per merged
        shard along dim 0 (a per-tensor scale, which checkpoints save as [] or [1])."""
        target, source = param.data, read_all(loaded)
        if getattr(param, "shard_indexed", False):
            target = target[shard_index]
            if source.numel() == target.numel():
                source = source.reshape(target.shape)
        self.store(param, target, source, shard_index)

    def store(
        self, param: nn.Parameter, target: torch.Tensor, source: torch.Tensor, shard_index: int
    ) -> None:
        """Copies source into target, a view of param, and notes the shard as loaded."""
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        copy_weight(target, source, f"{self.prefix}.{name}")
        self._loaded_shards.add((name, shard_index))

    def unloaded(self) -> list[str]:
        """The parameters (and which merged shard of them) no weight_loader call filled."""
        shards = range(len(self.output_partition_sizes))
        return [
            f"{self.prefix}.{name}[{i}]"
            for name, _ in self.named_parameters(recurse=False)
            for i in shards
            if (name, i) not in self._loaded_shards
        ]


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(
            input_size, output_size, bias, quant_config, prefix, input_size, [output_size], True
        )


class ColumnParallelLinear(LinearBase):
    """Each rank holds a slice of the output features (of each of output_partition_sizes'
    shards, for the merged layers below); gather_output all-gathers the full output."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        output_partition_sizes: list[int] | None = None,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        if output_partition_sizes is None:
            output_partition_sizes = [divide(output_size, tp_size, f"{prefix} output size")]
        self.gather_output = gather_output
        super().__init__(
            input_size,
            output_size,
            bias,
            quant_config,
            prefix,
            input_size,
            output_partition_sizes,
            True,
        )

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_gather(out) if self.gather_output else out

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        size = self.output_size_per_partition
        self.load_output_shard(param, loaded_weight, 0, 0, size, self.tp_rank * size)

    def load_output_shard(
        self,
        param: nn.Parameter,
        loaded: LoadedWeight,
        shard_index: int,
        offset: int,
        size: int,
        start: int,
    ) -> None:
        """Copies loaded[start : start + size] to param[offset : offset + size] along the
        param's output_dim; offset, size and start count output features, which a packed or
        blocked param holds fewer of. A param without an output_dim is not split."""
        dim = getattr(param, "output_dim", None)
        if dim is None:
            self.load_unsplit(param, loaded, shard_index)
            return
        held = param.data.shape[dim]

        def scaled(features: int) -> int:
            units = features * held
            if units % self.output_size_per_partition:
                raise ValueError(f"{self.prefix}: a shard boundary falls inside a packed value")
            return units // self.output_size_per_partition

        target = param.data.narrow(dim, scaled(offset), scaled(size))
        self.store(param, target, read_range(loaded, dim, scaled(start), scaled(size)), shard_index)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input fused (gate and up): shard_id i loads the
    i-th's checkpoint tensor."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.output_sizes = output_sizes
        sizes = [divide(s, tp_size, f"{prefix} output size") for s in output_sizes]
        super().__init__(
            input_size, sum(output_sizes), bias, gather_output, quant_config, prefix, sizes
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"{self.prefix}: a merged layer loads one shard at a time")
        sizes = self.output_partition_sizes
        offset, size = sum(sizes[:shard_id]), sizes[shard_id]
        self.load_output_shard(param, loaded_weight, shard_id, offset, size, self.tp_rank * size)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused, split by heads: each rank holds
    total_num_heads / tp query heads and total_num_kv_heads / tp KV heads, or one KV head
    replicated on tp / total_num_kv_heads ranks when the ranks outnumber the KV heads."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size, f"{prefix} number of attention heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "tensor_parallel_size")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, f"{prefix} number of KV heads")
            self.num_kv_head_replicas = 1
        sizes = [self.num_heads * head_size] + [self.num_kv_heads * head_size] * 2
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias, False, quant_config, prefix, sizes)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"{self.prefix}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        index = "qkv".index(shard_id)
        sizes = self.output_partition_sizes
        offset, size = sum(sizes[:index]), sizes[index]
        head_rank = self.tp_rank if index == 0 else self.tp_rank // self.num_kv_head_replicas
        self.load_output_shard(param, loaded_weight, index, offset, size, head_rank * size)


class RowParallelLinear(LinearBase):
    """Each rank holds a slice of the input features and computes a partial sum, all-reduced
    unless reduce_results is off; the bias is added once, by rank 0."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        local_input = divide(input_size, tp_size, f"{prefix} input size")
        super().__init__(
            input_size, output_size, bias, quant_config, prefix, local_input, [output_size], False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        return super().forward(x)

    @property
    def rank_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp_rank == 0 else None

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:
            self.load_unsplit(param, loaded_weight, 0)
            return
        size = param.data.shape[dim]
        self.store(param, param.data, read_range(loaded_weight, dim, self.tp_rank * size, size), 0)


def _fusable(linear: LinearBase, x: torch.Tensor, row: int) -> bool:
    """A single short CUDA row into a full-precision weight: the GEMV kernels' case."""
    unquantized = type(linear.quant_method) is UnquantizedLinearMethod
    return unquantized and single_cuda_row(x) and row <= FUSED_MAX_ROW


def rms_norm_linear(
    norm: RMSNorm, linear: LinearBase, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual), the residual taken as 0 when None; one
    kernel for a single short CUDA row; into an FP8 layer, the norm's rows quantized by the
    norm's kernel."""
    if _fusable(linear, x, x.shape[1]):
        out, residual = kernels.rms_norm_gemv(
            x, residual, norm.weight, norm.eps, linear.weight, linear.rank_bias
        )
        return linear.combine(out), residual
    if linear.quant_method.takes_fp8_rows(x):
        xq, x_scale = kernels.rms_norm_fp8(x, residual, norm.weight, norm.eps, MIN_SCALE)
        return linear.forward_fp8(xq, x_scale, x.dtype), x if residual is None else residual
    if residual is None:
        return linear(norm(x)), x
    x, residual = norm(x, residual)
    return linear(x), residual


def fuses_silu_and_mul(linear: LinearBase) -> bool:
    """The AVX-512 CPU GEMM's weight [gate | up], each half whole panels, no bias."""
    packed = getattr(linear, "cpu_gemm_packed", False)
    return packed and linear.weight.shape[0] % 2 == 0 and linear.rank_bias is None


def linear_silu_and_mul(linear: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of linear(x) = [gate | up] in one pass, for a linear that
    fuses_silu_and_mul: [gate | up] is never written (the offline fp32 workload 1.05x on the
    Zen 4: bench/results/throughput_fp32_cpu_smollm2_zen4_silu_fused_*.json)."""
    return cpu_gemm_silu_and_mul(x, linear.weight)


def silu_and_mul_linear(linear: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) * up) for x = [gate | up]; one kernel for a single short CUDA row; into
    an FP8 layer, the activations quantized by the SiLU-and-mul's kernel."""
    if _fusable(linear, x, x.shape[1] // 2):
        return linear.combine(kernels.silu_and_mul_gemv(x, linear.weight, linear.rank_bias))
    if linear.quant_method.takes_fp8_rows(x):
        xq, x_scale = kernels.silu_and_mul_fp8(x, MIN_SCALE)
        return linear.forward_fp8(xq, x_scale, x.dtype)
    return linear(silu_and_mul(x))


# Row counts past these are left to be built when first met: such a GEMM takes far longer than
# its build (0.7 ms) and a server meets few of their sizes, while warming them costs their
# GEMMs' time. SmolLM2's warm-up to 2,048 rows (lm_head 256) took 7.8 s of one core, 4.1 of
# them in the lm_head's 48 sizes of 49,152 outputs; to 512 and 64 it takes 2.2 s, and the 80
# sizes left out can add about 45 MiB as a server meets them (0.6 MiB each).
WARM_UP_MAX_ROWS = 512
WARM_UP_MAX_HEAD_ROWS = 64


@torch.inference_mode()
def warm_up_packed_linears(model: nn.Module, max_rows: int, max_head_rows: int) -> None:
    """Run each oneDNN-packed weight's GEMM once at every padded row count it can meet, up to
    WARM_UP_MAX_ROWS (the lm_head, which sees one row per request sampled, up to
    WARM_UP_MAX_HEAD_ROWS). oneDNN builds a kernel per shape and row count and keeps it, about
    0.6 MiB and 0.7 ms each on SmolLM2's shapes: built here, that memory is taken at start-up
    instead of growing with each new batch size a server meets, and no step waits for a build."""
    warmed = set()
    # random rows, not zeros: the bf16 mode's lm_head refines every logit tied with a row's
    # largest, and zeros tie all of them
    generator = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        if not getattr(module, "onednn_packed", False):
            continue
        if name == "lm_head":
            limit = min(max_head_rows, WARM_UP_MAX_HEAD_ROWS)
        else:
            limit = min(max_rows, WARM_UP_MAX_ROWS)
        rows_in = module.input_size_per_partition
        shape = (rows_in, module.output_size_per_partition, module.rank_bias is not None, limit)
        if shape in warmed:
            continue
        warmed.add(shape)
        for rows in sorted({padded_rows(r) for r in range(1, limit + 1)}):
            x = torch.randn(rows, rows_in, generator=generator)
            module.quant_method.apply(module, x, module.rank_bias)


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    """Each layer's quant_method prepares its loaded weights (oneDNN packing on CPU, ...)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
