"""Our Llama-family model against Hugging Face transformers on random tiny configs."""

import pytest
import torch
import transformers

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.torch_backend import TorchAttentionBackend
from asyncllm.models.llama import LlamaForCausalLM

BLOCK_SIZE = 4

TINY = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

CONFIGS = {
    "llama3_rope_tied": (
        transformers.LlamaConfig,
        dict(
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, head_dim=8)),
    "qwen2_bias": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3_qk_norm": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True)),
}


def make_pair(name: str) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    config_class, extra = CONFIGS[name]
    config = config_class(**TINY, **extra)
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ours = LlamaForCausalLM(config, TorchAttentionBackend()).eval()
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def kv_caches(model: LlamaForCausalLM, num_blocks: int = 64) -> list[torch.Tensor]:
    return [torch.zeros(spec.shape(num_blocks, BLOCK_SIZE)) for spec in model.kv_cache_specs]


def metadata(spans: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    """spans: per request (num_computed, num_new)."""
    query_lens = [n for _, n in spans]
    seq_lens = [c + n for c, n in spans]
    slots = [
        table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for (c, n), table in zip(spans, tables)
        for p in range(c, c + n)
    ]
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("name", CONFIGS)
@torch.inference_mode()
def test_prefill_logits_match_hf(name: str) -> None:
    hf, ours = make_pair(name)
    ids = torch.randint(0, TINY["vocab_size"], (37,), generator=torch.Generator().manual_seed(1))
    expected = hf(ids[None]).logits[0]
    meta = metadata([(0, 37)], [list(range(10))])
    hidden = ours(ids, torch.arange(37), kv_caches(ours), meta)
    torch.testing.assert_close(ours.compute_logits(hidden), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CONFIGS)
@torch.inference_mode()
def test_batched_chunks_and_decode_match_hf(name: str) -> None:
    """Two requests in one flat batch: a chunked prefill continued over a cached prefix, and decode."""
    hf, ours = make_pair(name)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, TINY["vocab_size"], (23,), generator=gen)
    b = torch.randint(0, TINY["vocab_size"], (9,), generator=gen)
    tables = [[5, 2, 9, 11, 3, 7], [1, 8, 4]]
    caches = kv_caches(ours)
    # step 1: first 10 tokens of a, all but the last token of b
    meta = metadata([(0, 10), (0, 8)], tables)
    ours(torch.cat([a[:10], b[:8]]), torch.cat([torch.arange(10), torch.arange(8)]), caches, meta)
    # step 2: the remaining 13 tokens of a, the last token of b (a decode-like row)
    meta = metadata([(10, 13), (8, 1)], tables)
    hidden = ours(
        torch.cat([a[10:], b[8:]]),
        torch.cat([torch.arange(10, 23), torch.tensor([8])]),
        caches,
        meta,
    )
    logits = ours.compute_logits(hidden)
    torch.testing.assert_close(logits[:13], hf(a[None]).logits[0, 10:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[13], hf(b[None]).logits[0, 8], rtol=1e-4, atol=1e-4)
    # step 3: pure decode of both (the batched decode path)
    meta = metadata([(23, 1), (9, 1)], tables)
    nxt = torch.tensor([7, 3])
    hidden = ours(nxt, torch.tensor([23, 9]), caches, meta)
    logits = ours.compute_logits(hidden)
    full_a = torch.cat([a, nxt[:1]])
    full_b = torch.cat([b, nxt[1:]])
    torch.testing.assert_close(logits[0], hf(full_a[None]).logits[0, -1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], hf(full_b[None]).logits[0, -1], rtol=1e-4, atol=1e-4)
