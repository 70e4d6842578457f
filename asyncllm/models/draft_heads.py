"""Draft heads from their checkpoint folder (config.json and safetensors): which head a
speculative method and the config's `architectures` name, checked against the target they
read, built on the target's device in its dtype."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import ModelConfig
from asyncllm.layers.linear import LinearBase, process_weights_after_loading
from asyncllm.model_files.model_path import resolve_model_path
from asyncllm.models.eagle import Eagle3LlamaHead, EagleLlamaHead
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.loader import iter_safetensors
from asyncllm.models.medusa import MedusaConfig, MedusaHeads

# the EAGLE authors' EAGLE-1/2 checkpoints name plain LlamaForCausalLM
HEAD_ARCHITECTURES = {
    "eagle": {"EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLM"},
    "eagle3": {"Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"},
    "medusa": {"MedusaModel"},
}


def load_draft_head(
    method: str,
    model: str,
    target: nn.Module,
    target_config: ModelConfig,
    backend: AttentionBackend,
) -> nn.Module:
    folder = resolve_model_path(model)
    raw = json.loads((folder / "config.json").read_text())
    _check_architecture(method, raw)
    names = tensor_names(folder)
    with torch.device(target_config.device):
        if method == "medusa":
            config = MedusaConfig.from_json(raw)
            _check_sizes(config.hidden_size, config.vocab_size, target_config)
            head = MedusaHeads(config, names)
        else:
            # imported here: transformers' Llama module costs a CPU server 2.5 s of its start
            from transformers import LlamaConfig

            head = _eagle_head(
                method, LlamaConfig.from_dict(raw), target, target_config, backend, names
            )
    _load_weights(head, folder)
    head.to(target_config.compute_dtype)  # the float tensors: d2t and token_map keep int64
    head.eval()
    process_weights_after_loading(head)
    return head


def tensor_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return {name.removeprefix("model.") for name in names}


def eagle_aux_layers(config: PretrainedConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input states an EAGLE-3 head reads: the checkpoint's
    eagle_aux_hidden_state_layer_ids, else vLLM's choice (low, middle, high)."""
    nested = getattr(config, "eagle_config", None) or {}
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    ids = ids or nested.get("eagle_aux_hidden_state_layer_ids")
    ids = ids or (2, num_target_layers // 2, num_target_layers - 3)
    if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"speculative model: EAGLE-3 reads three of the target's {num_target_layers} "
            f"layers; eagle_aux_hidden_state_layer_ids {list(ids)} do not name three"
        )
    return tuple(ids)


def _eagle_head(
    method: str,
    config: PretrainedConfig,
    target: nn.Module,
    target_config: ModelConfig,
    backend: AttentionBackend,
    names: set[str],
) -> nn.Module:
    if not isinstance(target, LlamaForCausalLM):
        raise ValueError(f"speculative method {method!r} drafts for Llama-family targets")
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    _check_sizes(target_hidden, config.vocab_size, target_config)
    if method == "eagle":
        if config.num_hidden_layers < 1:
            raise ValueError("speculative model: an EAGLE head needs a decoder layer")
        return EagleLlamaHead(config, backend, target, names)
    if config.num_hidden_layers != 1:
        raise ValueError("speculative model: EAGLE-3 heads of one decoder layer are supported")
    draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
    if "lm_head.weight" not in names and draft_vocab != config.vocab_size:
        raise ValueError("speculative model: a head of its own vocabulary needs its lm_head")
    aux_layers = eagle_aux_layers(config, len(target.layers))
    return Eagle3LlamaHead(config, backend, target, names, aux_layers)


def _check_architecture(method: str, raw: dict) -> None:
    known = HEAD_ARCHITECTURES[method]
    named = raw.get("architectures") or []
    if method == "medusa" and not named:
        return  # the Medusa authors' configs name none
    if not known & set(named):
        raise ValueError(
            f"speculative model: architecture {named} is not a {method} head; "
            f"expected one of {', '.join(sorted(known))}"
        )


def _check_sizes(hidden_size: int, vocab_size: int, target: ModelConfig) -> None:
    config = target.hf_config
    if hidden_size != config.hidden_size:
        raise ValueError(
            f"speculative model: the head reads hidden states of size {hidden_size}; "
            f"the target's are {config.hidden_size}"
        )
    if vocab_size != config.vocab_size:
        raise ValueError(
            f"speculative model: vocabulary of {vocab_size} tokens; "
            f"the target's has {config.vocab_size}"
        )


def _load_weights(head: nn.Module, folder: Path) -> None:
    loaded = head.load_weights(iter_safetensors(folder))
    missing = {name for name, _ in head.named_parameters()} - loaded
    missing |= {n for m in head.modules() if isinstance(m, LinearBase) for n in m.unloaded()}
    if missing:
        raise ValueError(
            f"speculative model: the checkpoint lacks {', '.join(sorted(missing)[:5])}"
        )
