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
        write_target(path, tokenizer_from=default_model_dir)
        hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
        llm = LLM(**engine_kwargs(path))
        return cls(path, hf, generate(llm, GREEDY), generate(llm, SEEDED))


def write_target(path: Path, tokenizer_from: Path | None = None) -> Path:
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
    if tokenizer_from is not None:
        transformers.AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    return path


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


def eagle_tensors(own_embedding: bool = False) -> dict[str, torch.Tensor]:
    """EAGLE-1/2: fc (with its bias) over [embedding; hidden], a layer without input norm."""
    tensors = {"fc.weight": random(HIDDEN, 2 * HIDDEN), "fc.bias": random(HIDDEN)}
    tensors |= layer_tensors("layers.0", HIDDEN, input_norm=False)
    if own_embedding:
        tensors["embed_tokens.weight"] = random(VOCAB, HIDDEN)
    return tensors


def eagle3_tensors(draft_vocab: int = 16) -> dict[str, torch.Tensor]:
    """EAGLE-3: fc over three layers' states, midlayer reading 2H, its own small vocabulary
    (d2t: target id minus draft id; t2d: which target ids it covers)."""
    torch.manual_seed(3)
    draft_to_target = torch.randperm(VOCAB)[:draft_vocab].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_to_target] = True
    tensors = {
        "fc.weight": random(HIDDEN, 3 * HIDDEN),
        "midlayer.hidden_norm.weight": 1 + random(HIDDEN),
        "norm.weight": 1 + random(HIDDEN),
        "lm_head.weight": random(draft_vocab, HIDDEN),
        "d2t": draft_to_target - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    return tensors | layer_tensors("midlayer", 2 * HIDDEN, input_norm=True)


NUM_HEADS = 3


def medusa_tensors() -> dict[str, torch.Tensor]:
    """vLLM's layout: blocks.i.layers.0 (with its bias), lm_heads.i."""
    tensors = {}
    for i in range(NUM_HEADS):
        block, lm_head = f"blocks.{i}.layers.0", f"lm_heads.{i}"
        tensors[f"{block}.weight"] = random(HIDDEN, HIDDEN)
        tensors[f"{block}.bias"] = random(HIDDEN)
        tensors[f"{lm_head}.weight"] = random(VOCAB, HIDDEN) * 5
    return tensors


def medusa_config(**keys) -> dict:
    return dict(hidden_size=HIDDEN, vocab_size=VOCAB, medusa_fc_bias=True, **keys)


def write_heads(method: str, path: Path) -> Path:
    """A head of random weights for the target, in the published layout."""
    if method == "eagle":
        torch.manual_seed(1)
        return write_head(path, head_config("LlamaForCausalLM", bias=True), eagle_tensors())
    if method == "eagle3":
        config = head_config(
            "LlamaForCausalLMEagle3",
            draft_vocab_size=16,
            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]},
        )
        return write_head(path, config, eagle3_tensors())
    torch.manual_seed(4)
    config = medusa_config(architectures=["MedusaModel"], num_heads=NUM_HEADS, num_hidden_layers=1)
    return write_head(path, config, medusa_tensors())


def engine_kwargs(path: Path) -> dict:
    return dict(model=str(path), max_model_len=256, kv_cache_memory=1 << 24)


def generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def speculate(target: Target, method: str, head_dir, num_tokens: int = 3, **kwargs) -> LLM:
    config = {"method": method, "model": str(head_dir), "num_speculative_tokens": num_tokens}
    return LLM(**engine_kwargs(target.path), **kwargs, speculative_config=config)


def drafter(llm: LLM):
    """The proposer next to the target (an in-process engine's)."""
    return llm.core_client.core.executor.model_runner.drafter


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


def record_device_drafts(monkeypatch, proposer_class) -> list[tuple[int, list[int]]]:
    """The same for a proposer that drafts on the device (propose(DraftBatch))."""
    drafted = []
    original = proposer_class.propose

    def recording(self, batch):
        drafts = original(self, batch)
        drafted.extend(zip(batch.next_positions.tolist(), drafts.tolist()))
        return drafts

    monkeypatch.setattr(proposer_class, "propose", recording)
    return drafted
