"""The engine's greedy ids on random tiny MoE models equal Hugging Face's, over a batch that is
chunked, hits the prefix cache and is preempted."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_engine_matches_hf import hf_greedy
from test_moe_models import CONFIGS, TINY

from asyncllm import LLM, SamplingParams

VOCAB = 49152  # SmolLM2's tokenizer
NEW_TOKENS = 10


def save_model(name: str, folder, tokenizer_dir) -> transformers.PreTrainedModel:
    config_class, extra = CONFIGS[name]
    config = config_class(**{**TINY, **extra, "vocab_size": VOCAB}, bos_token_id=1, eos_token_id=2)
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    hf.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return hf


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_dense_layer", "deepseek_v2_grouped_topk"])
def test_greedy_batch_with_chunks_prefix_hits_and_preemption_equals_hf(
    name: str, default_model_dir, tmp_path
) -> None:
    hf = save_model(name, tmp_path, default_model_dir)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, VOCAB, (12,), generator=gen).tolist()
    prompts = [
        prefix + torch.randint(3, VOCAB, (3 + 2 * i,), generator=gen).tolist() for i in range(5)
    ]
    llm = LLM(
        model=str(tmp_path),
        max_model_len=128,
        max_num_batched_tokens=24,
        num_kv_blocks=18,
        block_size=4,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm.core_client.core
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.prefix_cache_hits > 0
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
