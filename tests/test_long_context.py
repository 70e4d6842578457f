"""Contexts of max_model_len 40,960 (issue 28's long-context workload) on a tiny model: a prompt
of 40,900 tokens, chunked, beside a short one, in a KV cache that holds one long sequence (so
the long prompt is preempted and comes back through the prefix cache), equals Hugging Face
transformers run over the same tokens; on CPU, and on a GPU through the Triton kernels and CUDA
graphs (decode graphs captured for max_model_len)."""

from __future__ import annotations

import inspect
import random
from pathlib import Path

import pytest
import torch
import transformers

from asyncllm import LLM, SamplingParams

MAX_MODEL_LEN = 40960
# the short request decodes on past the long prompt's 11 chunks, holding its blocks
NEW_TOKENS = (48, 8)
# one sequence of max_model_len, and a few blocks more
NUM_KV_BLOCKS = MAX_MODEL_LEN // 16 + 40


def write_long_model(path: Path, hidden_size: int, num_heads: int, head_dim: int) -> Path:
    """A random one-layer Qwen3 with a 40,960-position rotary cache (the Qwen3-0.6B shape's),
    two query heads a KV head."""
    config = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // 2,
        head_dim=head_dim,
        max_position_embeddings=MAX_MODEL_LEN,
        rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@torch.inference_mode()
def hf_greedy_logprobs(model, prompt: list[int], n: int, chunk: int = 8192) -> list[torch.Tensor]:
    """Greedy decoding with HF's KV cache, the prompt fed in chunks; each step's log-softmax."""
    cache = transformers.DynamicCache()
    # newer transformers (5.24 here) call it cache and warn at past_key_values; the GPU image's
    # 5.17 knows only past_key_values and drops `cache` unseen (each step then had no context)
    keyword = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )

    def forward(ids: list[int]) -> torch.Tensor:
        out = model(torch.tensor([ids], device=model.device), **{keyword: cache})
        return out.logits[0, -1].float().log_softmax(-1).cpu()

    for start in range(0, len(prompt), chunk):
        last = forward(prompt[start : start + chunk])
    steps = [last]
    for _ in range(n - 1):
        steps.append(forward([int(steps[-1].argmax())]))
    return steps


def assert_long_prompt_equals_hf(model_dir: Path, device: str, tolerance: float) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3000, MAX_MODEL_LEN - 60)]
    llm = LLM(
        model=str(model_dir),
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=4096,
        num_kv_blocks=NUM_KV_BLOCKS,
        dtype="float32",
        device=device,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
        for n in NEW_TOKENS
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # the long prompt's last chunk found no room beside the short request: it went back to
    # waiting and found its computed blocks in the prefix cache when it came back
    stats = llm.core_client.core.stats()
    assert stats.num_preemptions >= 1 and stats.prefix_cache_hits > 0

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.to(device).eval()
    for prompt, n, output in zip(prompts, NEW_TOKENS, outputs):
        completion = output.outputs[0]
        expected = hf_greedy_logprobs(hf, prompt, n)
        assert completion.token_ids == [int(step.argmax()) for step in expected]
        for logprobs, token, step in zip(completion.logprobs, completion.token_ids, expected):
            assert logprobs[token].logprob == pytest.approx(float(step[token]), abs=tolerance)


def test_long_prompt_chunked_and_preempted_equals_hf(tmp_path) -> None:
    model_dir = write_long_model(tmp_path, hidden_size=32, num_heads=2, head_dim=8)
    assert_long_prompt_equals_hf(model_dir, "cpu", tolerance=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_long_prompt_on_the_gpu_equals_hf(tmp_path) -> None:
    # the sizes of the other GPU engine tests' models, which every kernel's tiles take
    model_dir = write_long_model(tmp_path, hidden_size=256, num_heads=8, head_dim=64)
    # both sides on the GPU, in fp32: their sums over 40k keys differ in order, not precision
    assert_long_prompt_equals_hf(model_dir, "cuda", tolerance=1e-3)
