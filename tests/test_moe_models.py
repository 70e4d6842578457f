"""Mixtral, Qwen3-MoE and DeepSeek-V2 against Hugging Face transformers on random tiny configs
(fp32): on CPU the torch experts and MLA reference, on a GPU the Triton kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from test_model_vs_hf import BLOCK_SIZE
from test_model_vs_hf import metadata as host_metadata

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.torch_backend import TorchAttentionBackend
from asyncllm.models.loader import iter_safetensors
from asyncllm.models.registry import get_model_class

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 211
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    num_experts_per_tok=2,
)
# MLA with odd widths, two shared experts, a dense first layer; HF's DeepSeek needs as many KV
# heads as heads
DEEPSEEK = dict(
    num_key_value_heads=8,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=6,
    n_shared_experts=2,
    moe_intermediate_size=24,
    intermediate_size=80,
    first_k_dense_replace=1,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=0.707,
)
CONFIGS = {
    "mixtral": (
        transformers.MixtralConfig,
        dict(intermediate_size=48, num_local_experts=5, sliding_window=None),
    ),
    "qwen3_moe_dense_layer": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=16,
            intermediate_size=80,
            moe_intermediate_size=40,
            num_experts=6,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe_unnormalised": (
        transformers.Qwen3MoeConfig,
        dict(head_dim=16, moe_intermediate_size=40, num_experts=6, norm_topk_prob=False),
    ),
    "deepseek_v2_lite_yarn": (
        transformers.DeepseekV2Config,
        dict(DEEPSEEK, q_lora_rank=None, rope_parameters=YARN),
    ),
    "deepseek_v2_grouped_topk": (
        transformers.DeepseekV2Config,
        dict(
            DEEPSEEK,
            q_lora_rank=24,
            topk_method="group_limited_greedy",
            n_group=3,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.8),
        ),
    ),
}


def make_pair(name: str, max_short_step_tokens: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    config_class, extra = CONFIGS[name]
    config = config_class(**{**TINY, **extra})
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    backend = TorchAttentionBackend()
    backend.max_short_step_tokens = max_short_step_tokens
    ours = get_model_class(config)(config, backend).eval()
    loaded = ours.load_weights(hf.state_dict().items())
    assert loaded == {name for name, _ in ours.named_parameters()}
    return hf.to(DEVICE), ours.to(DEVICE)


def kv_caches(model: torch.nn.Module, num_blocks: int = 64) -> list[torch.Tensor]:
    shapes = [spec.shape(num_blocks, BLOCK_SIZE) for spec in model.kv_cache_specs]
    return [torch.zeros(shape, device=DEVICE) for shape in shapes]


def metadata(spans: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    meta = host_metadata(spans, tables)
    on_device = {
        f.name: getattr(meta, f.name).to(DEVICE)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    return dataclasses.replace(meta, **on_device)


def tokens(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts).to(DEVICE)


@pytest.mark.parametrize("name", CONFIGS)
@torch.inference_mode()
def test_prefill_logits_match_hf(name: str) -> None:
    hf, ours = make_pair(name)
    ids = tokens(torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(1)))
    meta = metadata([(0, 29)], [list(range(8))])
    hidden = ours(ids, tokens(torch.arange(29)), kv_caches(ours), meta)
    expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours.compute_logits(hidden), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "name,max_short_step_tokens",
    [(name, 0) for name in CONFIGS] + [("deepseek_v2_grouped_topk", 16)],
)
@torch.inference_mode()
def test_chunks_prefix_hit_and_decode_match_hf(name: str, max_short_step_tokens: int) -> None:
    """Request b reuses a's first two blocks (a prefix hit) while a's prompt arrives in chunks;
    then both decode in one batch. With max_short_step_tokens, MLA attends the short steps'
    prompt rows in latent space too."""
    hf, ours = make_pair(name, max_short_step_tokens)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, VOCAB, (17,), generator=gen)
    b = torch.cat([a[:8], torch.randint(0, VOCAB, (5,), generator=gen)])
    tables = [[6, 2, 9, 4, 11], [6, 2, 7, 1]]
    caches = kv_caches(ours)
    a, b = a.to(DEVICE), b.to(DEVICE)
    ours(a[:11], tokens(torch.arange(11)), caches, metadata([(0, 11)], tables[:1]))
    meta = metadata([(11, 6), (8, 5)], tables)
    hidden = ours(
        tokens(a[11:], b[8:]),
        tokens(torch.arange(11, 17), torch.arange(8, 13)),
        caches,
        meta,
    )
    logits = ours.compute_logits(hidden)
    torch.testing.assert_close(logits[:6], hf(a[None]).logits[0, 11:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[6:], hf(b[None]).logits[0, 8:], rtol=1e-4, atol=1e-4)
    nxt = tokens(torch.tensor([5, 9]))
    hidden = ours(nxt, tokens(torch.tensor([17, 13])), caches, metadata([(17, 1), (13, 1)], tables))
    logits = ours.compute_logits(hidden)
    for row, prompt in enumerate([a, b]):
        full = torch.cat([prompt, nxt[row : row + 1]])
        expected = hf(full[None]).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["deepseek_v2_lite_yarn", "deepseek_v2_grouped_topk"])
@torch.inference_mode()
def test_mixed_step_of_decodes_around_prompt_chunks_matches_hf(name: str) -> None:
    """Decode rows before, between and after two prompt chunks in one step: the latent
    attention's runs of decodes and its expanded chunks."""
    hf, ours = make_pair(name)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).to(DEVICE) for n in (9, 7, 12, 5, 6)]
    tables = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10], [11, 12]]
    caches = kv_caches(ours)
    done = [8, 0, 4, 4, 5]  # requests 0, 3, 4 decode their last prompt token; 1 and 2 chunk
    first = [r for r in range(5) if done[r]]
    meta = metadata([(0, done[r]) for r in first], [tables[r] for r in first])
    ours(
        tokens(*[prompts[r][: done[r]] for r in first]),
        tokens(*[torch.arange(done[r]) for r in first]),
        caches,
        meta,
    )
    spans = [(c, len(prompt) - c) for c, prompt in zip(done, prompts)]
    ids = tokens(*[prompts[r][c : c + n] for r, (c, n) in enumerate(spans)])
    positions = tokens(*[torch.arange(c, c + n) for c, n in spans])
    hidden = ours(ids, positions, caches, metadata(spans, tables))
    ends = torch.tensor([n for _, n in spans]).cumsum(0) - 1
    logits = ours.compute_logits(hidden)[ends.to(DEVICE)]
    for r, prompt in enumerate(prompts):
        expected = hf(prompt[None]).logits[0, -1]
        torch.testing.assert_close(logits[r], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_dense_layer", "deepseek_v2_lite_yarn"])
def test_checkpoint_experts_stack_at_load(name: str, tmp_path) -> None:
    """A saved checkpoint's per-expert tensors load into the same stacked weights."""
    hf, from_state = make_pair(name)
    hf.cpu().save_pretrained(tmp_path)
    ours = get_model_class(hf.config)(hf.config, TorchAttentionBackend()).to(DEVICE)
    loaded = ours.load_weights(iter_safetensors(tmp_path))
    assert loaded == {n for n, _ in ours.named_parameters()}
    for (n, mine), (_, ref) in zip(ours.named_parameters(), from_state.named_parameters()):
        assert torch.equal(mine, ref), n
