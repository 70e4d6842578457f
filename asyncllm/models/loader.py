"""Build a model and fill its weights from safetensors files or with dummy random values."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import ModelConfig
from asyncllm.layers.linear import LoadedWeight, process_weights_after_loading
from asyncllm.models.registry import get_model_class


def load_model(config: ModelConfig, backend: AttentionBackend) -> nn.Module:
    model_class = get_model_class(config.hf_config)
    with torch.device(config.device), _default_dtype(config.dtype):
        model = model_class(config.hf_config, backend)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        loaded = model.load_weights(iter_safetensors(config.path))
        missing = {name for name, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"model: the checkpoint lacks {', '.join(sorted(missing)[:5])}")
    model = model.to(config.dtype).eval()
    process_weights_after_loading(model)
    return model


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


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Small random values: enough for speed benchmarks, with sane activations."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        generator = torch.Generator(device=param.device).manual_seed(seed)
        param.normal_(0.0, 0.02, generator=generator)
