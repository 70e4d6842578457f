"""Where FP8 checkpoints keep each attention layer's KV cache scales (per tensor), by the names
vLLM loads: `self_attn.k_scale` / `.v_scale`; the older `self_attn.kv_scale` (one scale for
both); compressed-tensors' `self_attn.k_proj.output_scale` / `v_proj.output_scale` (from a
`kv_cache_scheme`, before it named them as vLLM does); ModelOpt's `self_attn.k_proj.k_scale` /
`v_proj.v_scale`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

_NAME = re.compile(
    r"(?P<attn>.*self_attn)\."
    r"(?:(?P<proj>[kv])_proj\.(?P<proj_scale>output_scale|[kv]_scale)|(?P<scale>[kv]_scale|kv_scale))$"
)


@dataclass(frozen=True)
class KVScaleName:
    attention: str  # the attention module's name, e.g. layers.3.self_attn
    planes: str  # "k", "v" or "kv": which of the layer's scales the tensor sets


def kv_scale_name(name: str) -> KVScaleName | None:
    """The attention layer and planes a checkpoint tensor scales; None when it is no KV scale
    (k_proj.weight_scale, k_proj.input_scale and the like are the projection's own)."""
    match = _NAME.match(name)
    if match is None:
        return None
    if match["scale"] is not None:
        return KVScaleName(match["attn"], match["scale"].removesuffix("_scale"))
    scale = match["proj_scale"]
    if scale != "output_scale" and scale[0] != match["proj"]:
        return None
    return KVScaleName(match["attn"], match["proj"])


def kv_scale_value(name: str, tensor: torch.Tensor) -> float:
    """The one positive finite number a per-tensor scale holds; ValueError naming the tensor."""
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint tensor {name!r}: a KV cache scale must be one number per layer "
            f"(per tensor), got shape {tuple(tensor.shape)}"
        )
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be > 0, got {value}")
    return value
