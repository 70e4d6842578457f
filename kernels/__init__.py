"""Triton kernels for asyncllm: paged attention, KV cache writes, fused norm / rotary / activation.

Deliberately no __version__: Hugging Face transformers probes for an unrelated package also
importable as `kernels` and treats one without a version in its supported range as absent.
"""

from kernels.activation import silu_and_mul
from kernels.cache import reshape_and_cache
from kernels.decode_attention import choose_num_splits, paged_decode_attention
from kernels.fp8_gemm import fp8_block_gemm
from kernels.fp8_quant import quantize_fp8
from kernels.fused_moe import fused_experts
from kernels.gemv import gemv, rms_norm_gemv, silu_and_mul_gemv
from kernels.int4_gemm import int4_gemm
from kernels.mla_decode import paged_mla_decode, write_latent_cache
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.prefill_attention import paged_prefill_attention
from kernels.qkv_prep import norm_rope_and_cache
from kernels.rotary import rotary_embedding
from kernels.sampling import prepare_logits, row_logprobs, sample_masked

__all__ = [
    "choose_num_splits",
    "fp8_block_gemm",
    "fused_add_rms_norm",
    "fused_experts",
    "gemv",
    "int4_gemm",
    "norm_rope_and_cache",
    "paged_decode_attention",
    "paged_mla_decode",
    "paged_prefill_attention",
    "prepare_logits",
    "quantize_fp8",
    "reshape_and_cache",
    "rms_norm_gemv",
    "rms_norm",
    "rotary_embedding",
    "row_logprobs",
    "sample_masked",
    "silu_and_mul_gemv",
    "silu_and_mul",
    "write_latent_cache",
]
