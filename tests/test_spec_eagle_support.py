"""Helpers the EAGLE and Medusa tests share: a random target over 32 tokens, its greedy
tokens and its HF twin, head checkpoints written in their published layout, and the drafts
a proposer makes, recorded.

No tests here; test_spec_eagle.py and test_spec_medusa.py import from this module.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from asyncllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]}, {"prompt_token_ids": [7]}]
HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 64, 4, 2, 128, 32
HEAD_DIM = HIDDEN // HEADS
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=8, seed=5, max_tokens=40, ignore_eos=True)


@dataclass
class Target:
    """A random 4-layer Llama over 32 tokens (EAGLE-3's default layers 2, 2 and 1 exist), its
    HF twin and its tokens for PROMPTS without speculation, greedy and seeded."""

    path: Path
    hf: transformers.LlamaForCausalLM
    greedy: list[list[int]]
    seeded: list[list[int]]

    @classmethod
    def write(cls, default_model_dir: Path, path: Path) -> "Target":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_hidden_layers=4,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            max_position_embeddings=256,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
        )
        config.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
        transformers.AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
        hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
        llm = LLM(**engine_kwargs(path))
        return cls(path, hf, generate(llm, GREEDY), generate(llm, SEEDED))


def head_config(architecture: str, **keys) -> dict:
    """A one-layer head's config.json; keys add to it or replace its own."""
    return (
        dict(
            architectures=[architecture],
            model_type="llama",
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_hidden_layers=1,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            vocab_size=VOCAB,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
        )
        | keys
    )


def random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) * 0.2


def layer_tensors(prefix: str, qkv_input: int, input_norm: bool) -> dict[str, torch.Tensor]:
    tensors = {
        f"{prefix}.self_attn.q_proj.weight": random(HEADS * HEAD_DIM, qkv_input),
        f"{prefix}.self_attn.k_proj.weight": random(KV_HEADS * HEAD_DIM, qkv_input),
        f"{prefix}.self_attn.v_proj.weight": random(KV_HEADS * HEAD_DIM, qkv_input),
        f"{prefix}.self_attn.o_proj.weight": random(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": random(INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": random(INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": random(HIDDEN, INTER),
        f"{prefix}.post_attention_layernorm.weight": 1 + random(HIDDEN),
    }
    if input_norm:
        tensors[f"{prefix}.input_layernorm.weight"] = 1 + random(HIDDEN)
    return tensors


def write_head(path, config: dict, tensors: dict[str, torch.Tensor]):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, path / "model.safetensors")
    return path


def engine_kwargs(path: Path) -> dict:
    return dict(model=str(path), max_model_len=256, kv_cache_memory=1 << 24)


def generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def speculate(target: Target, method: str, head_dir, num_tokens: int = 3, **kwargs) -> LLM:
    config = {"method": method, "model": str(head_dir), "num_speculative_tokens": num_tokens}
    return LLM(**engine_kwargs(target.path), **kwargs, speculative_config=config)


def spec_stats(llm: LLM):
    return llm.core_client.core.spec_decoding_stats


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def record_drafts(monkeypatch, proposer_class) -> list[tuple[int, list[int]]]:
    """(the next token's position, the drafts after it) for each row of every step."""
    drafted = []
    original = proposer_class.draft

    def recording(self, step):
        drafts = original(self, step)
        drafted.extend(zip(step.next_positions.tolist(), drafts))
        return drafts

    monkeypatch.setattr(proposer_class, "draft", recording)
    return drafted
