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


@pytest.mark.parametrize(
    "name,async_scheduling",
    [
        ("mixtral", False),
        ("qwen3_moe_dense_layer", True),
        ("deepseek_v2_grouped_topk", False),
        ("deepseek_v2_grouped_topk", True),
    ],
)
def test_greedy_batch_with_chunks_prefix_hits_and_preemption_equals_hf(
    name: str, async_scheduling: bool, default_model_dir, tmp_path
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
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm.core_client.core
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.prefix_cache_hits > 0
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


GPU_SIZES = dict(
    vocab_size=4096, hidden_size=256, num_hidden_layers=3, max_position_embeddings=2048
)
GPU_CONFIGS = {
    "mixtral": (
        transformers.MixtralConfig,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=256,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            moe_intermediate_size=128,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
        ),
    ),
    "deepseek_v2": (
        transformers.DeepseekV2Config,
        dict(
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=None,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            moe_intermediate_size=128,
            intermediate_size=512,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(GPU_CONFIGS))
def gpu_model_dir(request, tmp_path_factory):
    config_class, extra = GPU_CONFIGS[request.param]
    config = config_class(**GPU_SIZES, **extra)
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def gpu_greedy(path, **kwargs) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 3, 16, 17, 40, 100, 255, 300, 700]
    prompts = [
        {"prompt_token_ids": torch.randint(10, 4096, (n,), generator=gen).tolist()} for n in lengths
    ]
    llm = LLM(model=str(path), kv_cache_memory=1 << 30, max_num_seqs=16, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.core_client.core.kv_cache_manager.usage == 0
    llm.core_client.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("max_num_batched_tokens", [512, 2048])
def test_cuda_graphs_give_the_same_tokens_as_eager(
    gpu_model_dir, max_num_batched_tokens: int
) -> None:
    """Whole-step, piecewise and decode graphs (the fused MoE and the MLA kernel captured)."""
    limits = dict(dtype="float32", max_num_batched_tokens=max_num_batched_tokens)
    eager = gpu_greedy(gpu_model_dir, enforce_eager=True, **limits)
    assert gpu_greedy(gpu_model_dir, **limits) == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bfloat16_engine_with_async_scheduling_runs(gpu_model_dir) -> None:
    """The default dtype with graphs and async scheduling: every prompt gets its tokens."""
    tokens = gpu_greedy(gpu_model_dir, async_scheduling=True)
    assert [len(t) for t in tokens] == [16] * 9
