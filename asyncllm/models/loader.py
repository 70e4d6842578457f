"""Build a model and fill its weights from safetensors files or with dummy random values."""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import ModelConfig
from asyncllm.layers.linear import LinearBase, LoadedWeight, process_weights_after_loading
from asyncllm.layers.quantization import QuantizationConfig, get_quantization_config
from asyncllm.layers.quantization.base import UnquantizedLinearMethod
from asyncllm.layers.quantization.cpu_bf16 import CpuBf16Config
from asyncllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from asyncllm.models.llama import Attention
from asyncllm.models.registry import get_model_class

logger = logging.getLogger(__name__)


def load_model(config: ModelConfig, backend: AttentionBackend) -> nn.Module:
    model_class = get_model_class(config.hf_config)
    quant_config = quantization_of(config)
    check_kv_cache_scheme(checkpoint_quantization(config), config.kv_cache_dtype)
    with torch.device(config.device), _default_dtype(config.compute_dtype):
        model = model_class(config.hf_config, backend, quant_config)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        loaded = model.load_weights(iter_safetensors(config.path))
        missing = {name for name, _ in model.named_parameters()} - loaded
        missing |= {n for m in model.modules() if isinstance(m, LinearBase) for n in m.unloaded()}
        if missing:
            raise ValueError(f"model: the checkpoint lacks {', '.join(sorted(missing)[:5])}")
    _cast_unquantized(model, config.compute_dtype)
    model.eval()
    process_weights_after_loading(model)
    if config.load_format != "dummy" and config.device.type == "cpu":
        map_embeddings_from_files(model, config.path)
    if config.kv_cache_dtype != "auto":
        _warn_without_kv_scales(model)
    return model


def checkpoint_quantization(config: ModelConfig) -> dict | None:
    """config.json's quantization_config, as a dict."""
    checkpoint = getattr(config.hf_config, "quantization_config", None)
    if checkpoint is not None and not isinstance(checkpoint, dict):
        checkpoint = checkpoint.to_dict()
    return checkpoint


def quantization_of(config: ModelConfig) -> QuantizationConfig | None:
    """From the checkpoint's quantization_config, else from --quantization (fp8 at load); for
    bfloat16 on CPU, bf16 weights under fp32 activations."""
    quantization = get_quantization_config(checkpoint_quantization(config), config.quantization)
    if config.compute_dtype == config.dtype:
        return quantization
    if quantization is not None:
        raise ValueError(
            f"dtype {config.dtype} on CPU stores the linear weights in bf16 under float32 "
            f"activations; it does not combine with quantization {quantization.name!r}"
        )
    return CpuBf16Config.for_this_cpu()


# what a compressed-tensors kv_cache_scheme must say for the e4m3 cache of --kv-cache-dtype fp8
_FP8_KV_CACHE_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor"}


def check_kv_cache_scheme(checkpoint: dict | None, kv_cache_dtype: str) -> None:
    """An FP8 cache needs the checkpoint's KV cache scheme, if it has one, to be e4m3 with
    per-tensor scales; ValueError naming the field that disagrees."""
    scheme = (checkpoint or {}).get("kv_cache_scheme")
    if kv_cache_dtype == "auto" or scheme is None:
        return
    if not isinstance(scheme, dict):
        raise ValueError("quantization_config.kv_cache_scheme must be a JSON object")
    found = {"strategy": "tensor", **{k: v for k, v in scheme.items() if v is not None}}
    for key, expected in _FP8_KV_CACHE_SCHEME.items():
        if found.get(key) != expected:
            raise ValueError(
                f"quantization_config.kv_cache_scheme.{key} is {found.get(key)!r}, but "
                f"kv_cache_dtype {kv_cache_dtype!r} stores e4m3 with one scale per layer "
                f"({key} {expected!r})"
            )


def _warn_without_kv_scales(model: nn.Module) -> None:
    """Once a load, as vLLM warns: layers whose checkpoint has no KV cache scales."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    unscaled = sum(layer.kv_scales is None for layer in layers)
    if unscaled:
        logger.warning(
            "%d of %d attention layers have no KV cache scales in the checkpoint: their FP8 "
            "cache stores keys and values unscaled (scale 1.0), saturating past +-448",
            unscaled,
            len(layers),
        )


def _cast_unquantized(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's dtype for every float tensor but a quantized layer's, whose parameters keep
    their own dtypes (FP8, int32, fp32 scales) until its method repacks them."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not isinstance(method, UnquantizedLinearMethod):
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters made in the model's dtype: built in float32 first, Mixtral-8x7B's 47B weights
    would need 187 GB of device memory before the cast."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, LoadedWeight]]:
    """Every tensor of model.safetensors or of the shards an index names, as a slice that reads
    from the file only what the rank's weight loader indexes (its shard)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors files in {folder} (use load_format='dummy'?)")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_slice(name)


# safetensors dtype names -> the numpy dtype of the same bytes and the torch dtype they hold
_MAPPED_DTYPES = {
    "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16),
    "BF16": (np.uint16, torch.bfloat16),
}


def map_embeddings_from_files(model: nn.Module, folder: Path) -> None:
    """On CPU an input embedding stored whole in the model's dtype reads its rows from the
    checkpoint's pages (a private mapping) instead of a copy: only the rows of the tokens met
    become resident, and the kernel may drop them again. SmolLM2's tied embedding was otherwise
    held twice, dense (113 MB) beside the lm_head's oneDNN-packed copy. Done after the packing,
    which reads every row."""
    for module in model.modules():
        if not isinstance(module, VocabParallelEmbedding):
            continue
        mapped = mapped_tensor(folder, f"{module.prefix}.weight")
        weight = module.weight
        if mapped is not None and (mapped.shape, mapped.dtype) == (weight.shape, weight.dtype):
            weight.data = mapped


def mapped_tensor(folder: Path, name: str) -> torch.Tensor | None:
    """The checkpoint tensor `name` as a copy-on-write view of its file; None when no file of
    the folder holds it, or in a dtype this does not map."""
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            entry = json.loads(f.read(header_size)).get(name)
        if entry is None:
            continue
        if entry["dtype"] not in _MAPPED_DTYPES:
            return None
        np_dtype, dtype = _MAPPED_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = (end - begin) // np.dtype(np_dtype).itemsize
        array = np.memmap(file, np_dtype, mode="c", offset=8 + header_size + begin, shape=count)
        return torch.from_numpy(array).view(dtype).view(entry["shape"])
    return None


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Small random values: enough for speed benchmarks, with sane activations."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("g_idx"):  # input row k in group k // group_size
            groups = params[name.removesuffix("g_idx") + "scales"].shape[0]
            param.copy_(torch.arange(param.numel(), device=param.device) * groups // param.numel())
        elif not param.is_floating_point():  # packed 4-bit values
            param.random_(0, 2**31 - 1, generator=generator)
        elif "scale" in name.rpartition(".")[2]:
            param.uniform_(0.5e-3, 1.5e-3, generator=generator)
        elif param.element_size() == 1:  # FP8, which has no normal_
            noise = torch.empty(param.shape, device=param.device)
            param.copy_(noise.normal_(0.0, 0.02, generator=generator))
        else:
            param.normal_(0.0, 0.02, generator=generator)
