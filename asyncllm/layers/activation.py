import torch
import torch.nn.functional as F

import kernels
from kernels.cpu_layer_ops import cpu_layer_ops_available, silu_and_mul_bf16_cpu


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] -> silu(x[:, :I]) * x[:, I:]; the Triton kernel on CUDA. On CPU a bfloat16 x
    (the bf16 mode's gate_up output) gives bfloat16, computed in float32 and rounded once."""
    if x.is_cuda:
        return kernels.silu_and_mul(x)
    if x.dtype == torch.bfloat16 and cpu_layer_ops_available():
        return silu_and_mul_bf16_cpu(x)
    gate, up = x.float().chunk(2, dim=-1)
    return F.silu(gate).mul_(up).to(x.dtype)  # in place: one tensor fewer written
