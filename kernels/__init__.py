"""Triton kernels for asyncllm: paged attention, KV cache writes, fused norm / rotary / activation.

Deliberately no __version__: Hugging Face transformers probes for an unrelated package also
importable as `kernels` and treats one without a version in its supported range as absent.
"""

import importlib

# each kernel's module, imported at the kernel's first use: a CPU server never imports triton
# (0.8 s and 74 MB of its start-up). No module is named as a kernel is: importing a submodule
# sets the package's attribute of its name, which would hide the kernel
_MODULE_OF = {
    "silu_and_mul": "activation",
    "silu_and_mul_fp8": "activation",
    "reshape_and_cache": "cache",
    "choose_decode_split": "decode_attention",
    "paged_decode_attention": "decode_attention",
    "fp8_block_gemm": "fp8_gemm",
    "fp8_rowwise_gemm": "fp8_gemm",
    "fp8_rowwise_wins": "fp8_gemm",
    "quantize_fp8": "fp8_quant",
    "fused_experts": "fused_moe",
    "gemv": "gemv_kernels",
    "rms_norm_gemv": "gemv_kernels",
    "silu_and_mul_gemv": "gemv_kernels",
    "int4_gemm": "int4_kernels",
    "mla_norm_rope_and_cache": "mla_prep",
    "paged_mla_decode": "mla_decode",
    "write_latent_cache": "mla_decode",
    "route_top_k": "moe_routing",
    "tile_config": "fused_moe",
    "fused_add_rms_norm": "norm",
    "rms_norm": "norm",
    "rms_norm_fp8": "norm",
    "paged_prefill_attention": "prefill_attention",
    "rejection_sample": "rejection",
    "norm_rope_and_cache": "qkv_prep",
    "rotary_embedding": "rotary",
    "penalize": "sampling",
    "prepare_logits": "sampling",
    "record": "sampling",
    "restore": "sampling",
    "row_logprobs": "sampling",
    "sample_masked": "sampling",
}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kernels.{_MODULE_OF[name]}"), name)


__all__ = sorted(_MODULE_OF)
