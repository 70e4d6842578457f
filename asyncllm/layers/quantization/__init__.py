"""Quantized linear layers: get_quantization_config() picks the method from a checkpoint's
quantization_config (its quant_method) or from --quantization."""

from __future__ import annotations

from typing import Any

from asyncllm.layers.quantization.awq import AWQConfig
from asyncllm.layers.quantization.base_config import QuantizationConfig
from asyncllm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from asyncllm.layers.quantization.cpu_int8 import Int8Config
from asyncllm.layers.quantization.fp8 import Fp8Config
from asyncllm.layers.quantization.gptq import GPTQConfig

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    c.name: c for c in (Fp8Config, AWQConfig, GPTQConfig, CompressedTensorsConfig)
}
# --quantization methods that quantize an unquantized checkpoint's weights as it loads
AT_LOAD_METHODS: dict[str, type[Fp8Config | Int8Config]] = {
    c.name: c for c in (Fp8Config, Int8Config)
}


def get_quantization_config(
    checkpoint_config: dict[str, Any] | None, quantization: str | None
) -> QuantizationConfig | None:
    """The checkpoint's quantization_config (config.json) when it has one, checked against
    --quantization; else --quantization fp8 or int8 quantizes a 16-bit checkpoint at load; else
    None."""
    if checkpoint_config is None:
        if quantization is None:
            return None
        if quantization not in AT_LOAD_METHODS:
            raise ValueError(
                f"quantization {quantization!r} needs a checkpoint quantized that way; only "
                f"{' and '.join(map(repr, AT_LOAD_METHODS))} quantize at load"
            )
        return AT_LOAD_METHODS[quantization].at_load()
    if not isinstance(checkpoint_config, dict):
        raise ValueError("quantization_config must be a JSON object")
    method = checkpoint_config.get("quant_method")
    if method is None:
        raise ValueError("quantization_config.quant_method is missing")
    method = str(method).lower().replace("_", "-")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    if quantization is not None and quantization != method:
        raise ValueError(
            f"quantization {quantization!r} disagrees with the checkpoint's quantization_config.quant_method {method!r}"
        )
    return QUANTIZATION_METHODS[method].from_config(checkpoint_config)


__all__ = [
    "AT_LOAD_METHODS",
    "QUANTIZATION_METHODS",
    "QuantizationConfig",
    "get_quantization_config",
]
