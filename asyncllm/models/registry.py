"""Hugging Face `architectures` name -> model class."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from asyncllm.models.deepseek_v2 import DeepseekV2ForCausalLM
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.mixtral import MixtralForCausalLM
from asyncllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
}


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    for name in getattr(config, "architectures", None) or []:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise ValueError(
        f"model: architecture {config.architectures} is not supported; "
        f"supported: {', '.join(MODEL_CLASSES)}."
    )
