"""The mixture-of-experts side of GGUF conversion: Mixtral (which llama.cpp writes as arch "llama"
with experts), Qwen3-MoE ("qwen3moe") and DeepSeek-V2 ("deepseek2").

llama.cpp merges each layer's experts into one tensor per projection: ffn_gate_exps and
ffn_up_exps [n_expert, expert_ff, hidden], ffn_down_exps [n_expert, hidden, expert_ff]. The
converted folder holds them in transformers' own stacked layout, experts.gate_up_proj
[n_expert, 2 * expert_ff, hidden] and experts.down_proj, which FusedMoE.load_stacked reads.
Mixtral files written before llama.cpp merged the experts (April 2024) hold one tensor per
expert, blk.N.ffn_gate.E; they are stacked the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from asyncllm.model_files.safetensors_shards import TensorSource

# per-layer GGUF stems -> Hugging Face names after `model.layers.N.`, suffix kept
_LAYER_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    # halves that stack_split_sources joins: gate_up_proj and DeepSeek's kv_b_proj
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
}
# stacked parameters carry no `.weight` suffix in transformers
_STACKED_TENSORS = {"ffn_down_exps": "mlp.experts.down_proj"}
_SPLIT_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_ONE_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")

# llama.cpp's expert_gating_func for softmax (2 is DeepSeek-V3's sigmoid)
_GATING_SOFTMAX = 1
# llama.cpp stores DeepSeek's yarn mscale_all_dim as this multiple
_DEEPSEEK_YARN_LOG_MUL = 0.1

Metadata = dict[str, Any]  # the GGUF's `{arch}.` keys, prefix removed


def moe_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a per-layer MoE or MLA tensor (None: not one)."""
    if match := _SPLIT_EXPERT.fullmatch(gguf_name):
        layer, projection, expert = match.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{projection}_proj.weight"
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk":
        return None
    prefix = f"model.layers.{parts[1]}"
    if parts[2] in _STACKED_TENSORS:
        return f"{prefix}.{_STACKED_TENSORS[parts[2]]}"
    if parts[2] in _LAYER_TENSORS:
        return f"{prefix}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    return None


def applies_llama_rope_permutation(architecture: str) -> bool:
    """Only llama.cpp's llama converter (Mixtral included) interleaves Q/K rows; Qwen3 keeps
    Hugging Face's halves and DeepSeek's rope already runs on interleaved pairs."""
    return architecture == "llama"


def moe_config(architecture: str, metadata: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    """`base` (the llama config the metadata gives) turned into the MoE model's config; a
    llama without experts stays as it is."""
    build = _CONFIG_BUILDERS.get(architecture)
    if build is None or (architecture == "llama" and not metadata.get("expert_count")):
        return base
    return {**base, **build(metadata, base)}


def mixtral_config(metadata: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": require(metadata, "expert_count"),
        "num_experts_per_tok": require(metadata, "expert_used_count"),
        "intermediate_size": metadata.get("expert_feed_forward_length", base["intermediate_size"]),
        "sliding_window": None,
        **rope_fields(yarn_rope(metadata, base)),
    }


def qwen3_moe_config(metadata: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    used = require(metadata, "expert_used_count")
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": require(metadata, "expert_count"),
        "num_experts_per_tok": used,
        # llama.cpp's own fallback when the file lacks the expert width
        "moe_intermediate_size": metadata.get(
            "expert_feed_forward_length", base["intermediate_size"] // used
        ),
        # llama.cpp's qwen3moe graph routes every layer and renormalises the top-k weights
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
        **rope_fields(yarn_rope(metadata, base)),
    }


def deepseek_v2_config(metadata: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    if metadata.get("expert_gating_func", _GATING_SOFTMAX) != _GATING_SOFTMAX:
        raise ValueError("unsupported GGUF deepseek2 file: sigmoid expert gating (DeepSeek-V3)")
    rope_dim = require(metadata, "rope.dimension_count")
    # files since llama.cpp's MLA rewrite keep key/value_length for the latent (MQA) view
    qk_head_dim = metadata.get("attention.key_length_mla") or require(
        metadata, "attention.key_length"
    )
    v_head_dim = metadata.get("attention.value_length_mla") or require(
        metadata, "attention.value_length"
    )
    groups = metadata.get("expert_group_count", 1)
    rope = yarn_rope(metadata, base)
    if rope is not None:
        # llama.cpp keeps one mscale (DeepSeek-V2's mscale and mscale_all_dim are equal)
        mscale = metadata.get("rope.scaling.yarn_log_multiplier", 0.0) / _DEEPSEEK_YARN_LOG_MUL
        rope |= {"mscale": mscale, "mscale_all_dim": mscale}
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        # MLA: llama.cpp's single KV head is the latent; every head has its own K and V
        "num_key_value_heads": base["num_attention_heads"],
        "head_dim": rope_dim,
        "q_lora_rank": metadata.get("attention.q_lora_rank"),
        "kv_lora_rank": require(metadata, "attention.kv_lora_rank"),
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_head_dim,
        "n_routed_experts": require(metadata, "expert_count"),
        "n_shared_experts": metadata.get("expert_shared_count", 0),
        "num_experts_per_tok": require(metadata, "expert_used_count"),
        "moe_intermediate_size": require(metadata, "expert_feed_forward_length"),
        "first_k_dense_replace": metadata.get("leading_dense_block_count", 0),
        "routed_scaling_factor": metadata.get("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(metadata.get("expert_weights_norm", False)),
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
        "n_group": groups if groups > 1 else None,
        "topk_group": metadata.get("expert_group_used_count") if groups > 1 else None,
        **rope_fields(rope),
    }


def yarn_rope(metadata: Metadata, base: dict[str, Any]) -> dict[str, Any] | None:
    """The file's YaRN scaling as rope_parameters (None: it has none)."""
    if metadata.get("rope.scaling.type") != "yarn":
        return None
    return {
        "rope_type": "yarn",
        "rope_theta": base["rope_theta"],
        "factor": require(metadata, "rope.scaling.factor"),
        "original_max_position_embeddings": require(
            metadata, "rope.scaling.original_context_length"
        ),
        "beta_fast": metadata.get("rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": metadata.get("rope.scaling.yarn_beta_slow", 1.0),
    }


def rope_fields(rope: dict[str, Any] | None) -> dict[str, Any]:
    # both spellings, as the llama config writes them: transformers 5 reads rope_parameters
    return {} if rope is None else {"rope_parameters": rope, "rope_scaling": rope}


_CONFIG_BUILDERS: dict[str, Callable[[Metadata, dict[str, Any]], dict[str, Any]]] = {
    "llama": mixtral_config,
    "qwen3moe": qwen3_moe_config,
    "deepseek2": deepseek_v2_config,
}


def require(metadata: Metadata, key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF file lacks the MoE metadata field {key!r}")
    return metadata[key]


def check_expert_tensors(shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> None:
    """Every MoE layer's router and merged experts exist with the shapes the metadata gives;
    `shapes`: each GGUF tensor's logical (numpy-order) shape."""
    shapes = {**shapes, **split_expert_stacks(shapes)}
    for name, expected in expected_expert_shapes(config).items():
        if name not in shapes:
            raise ValueError(f"GGUF file lacks the expert tensor {name}")
        if shapes[name] != expected:
            raise ValueError(
                f"GGUF tensor {name} has shape {shapes[name]}, the metadata gives {expected}"
            )


def expected_expert_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    arch = config["architectures"][0]
    if arch == "MixtralForCausalLM":
        experts, inner, first = config["num_local_experts"], config["intermediate_size"], 0
    elif arch == "Qwen3MoeForCausalLM":
        experts, inner, first = config["num_experts"], config["moe_intermediate_size"], 0
    elif arch == "DeepseekV2ForCausalLM":
        experts, inner = config["n_routed_experts"], config["moe_intermediate_size"]
        first = config["first_k_dense_replace"]
    else:
        return {}
    hidden = config["hidden_size"]
    shapes = {}
    for layer in range(first, config["num_hidden_layers"]):
        blk = f"blk.{layer}"
        shapes[f"{blk}.ffn_gate_inp.weight"] = (experts, hidden)
        shapes[f"{blk}.ffn_gate_exps.weight"] = (experts, inner, hidden)
        shapes[f"{blk}.ffn_up_exps.weight"] = (experts, inner, hidden)
        shapes[f"{blk}.ffn_down_exps.weight"] = (experts, hidden, inner)
    return shapes


def split_expert_stacks(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The merged tensors' shapes that a split-expert file's blk.N.ffn_gate.E tensors stack to."""
    experts: dict[str, dict[int, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if match := _SPLIT_EXPERT.fullmatch(name):
            layer, projection, expert = match.groups()
            experts.setdefault(f"blk.{layer}.ffn_{projection}", {})[int(expert)] = shape
    stacks = {}
    for stem, by_expert in experts.items():
        first = by_expert.get(0)
        for expert in range(max(by_expert) + 1):
            if first is None or by_expert.get(expert) != first:
                raise ValueError(
                    f"GGUF tensor {stem}.{expert}.weight is missing or has a shape other than "
                    f"the first expert's"
                )
        stacks[f"{stem}_exps.weight"] = (len(by_expert), *first)
    return stacks


def stack_split_sources(sources: dict[str, TensorSource]) -> None:
    """Join, in place, what llama.cpp splits: a split-expert file's experts into one tensor per
    projection, each layer's expert gate and up halves into experts.gate_up_proj, and
    DeepSeek's k_b (stored transposed) and v_b into kv_b_proj. The joined tensors stream
    from their parts one expert (or head) at a time."""
    stack_one_expert_sources(sources)
    for gate_name in [n for n in sources if n.endswith(".mlp.experts.gate_proj.weight")]:
        prefix = gate_name.removesuffix(".gate_proj.weight")
        gate, up = sources.pop(gate_name), sources.pop(f"{prefix}.up_proj.weight")
        experts, inner, hidden = gate.shape
        name = f"{prefix}.gate_up_proj"
        shape = (experts, inner + up.shape[1], hidden)
        sources[name] = TensorSource(name, shape, partial(interleaved_slices, gate, up))
    for k_name in [n for n in sources if n.endswith(".self_attn.k_b_proj.weight")]:
        prefix = k_name.removesuffix(".k_b_proj.weight")
        k_b, v_b = sources.pop(k_name), sources.pop(f"{prefix}.v_b_proj.weight")
        # k_b [heads, kv_lora_rank, nope], v_b [heads, v, kv_lora_rank]
        heads, rank, nope = k_b.shape
        name = f"{prefix}.kv_b_proj.weight"
        shape = (heads * (nope + v_b.shape[1]), rank)
        sources[name] = TensorSource(name, shape, partial(kv_b_slices, k_b, v_b))


def interleaved_slices(first: TensorSource, second: TensorSource) -> Iterator[np.ndarray]:
    """Expert e's slice of `first`, then of `second`: the two joined on their second axis."""
    for a, b in zip(first.slices(), second.slices(), strict=True):
        yield a
        yield b


def kv_b_slices(k_b: TensorSource, v_b: TensorSource) -> Iterator[np.ndarray]:
    for k, v in zip(k_b.slices(), v_b.slices(), strict=True):
        yield k.T
        yield v


def stack_one_expert_sources(sources: dict[str, TensorSource]) -> None:
    experts: dict[tuple[str, str], dict[int, str]] = {}
    for name in sources:
        if match := _ONE_EXPERT.fullmatch(name):
            prefix, expert, projection = match.groups()
            experts.setdefault((prefix, projection), {})[int(expert)] = name
    for (prefix, projection), names in experts.items():
        parts = [sources.pop(names[e]) for e in range(len(names))]
        suffix = "" if projection == "down_proj" else ".weight"
        name = f"{prefix}.{projection}{suffix}"
        shape = (len(parts), *parts[0].shape)
        sources[name] = TensorSource(name, shape, partial(chained_chunks, parts))


def chained_chunks(parts: list[TensorSource]) -> Iterator[np.ndarray]:
    for part in parts:
        yield from part.chunks()
