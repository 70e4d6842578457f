"""Greedy generation on the real SmolLM2-135M equals Hugging Face transformers, token for token."""

import pytest
import torch
import transformers

from asyncllm import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Hi",
    "List three facts about the Moon, each on its own line, and then explain why the Moon "
    "always shows the same face to the Earth in two or three sentences.",
    "Translate to French: The weather is nice today and I would like to go for a walk.",
    "What is 12 * 7? Show your reasoning.",
    "def fibonacci(n):",
    "Explain the difference between a list and a tuple in Python to a beginner programmer who "
    "has only ever used spreadsheets, using a simple analogy from everyday life, and keep it under "
    "one hundred words if you can. Then give one short code example for each.",
]
NEW_TOKENS = 64


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt_ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with HF's KV cache; never stops early (like ignore_eos)."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = model(
            torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.mark.slow
def test_greedy_batch_equals_hf_generate(default_model_dir) -> None:
    llm = LLM(
        max_num_batched_tokens=256
    )  # small budget: prompts are chunked and batched with decodes
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32
    ).eval()
    for output in outputs:
        expected = hf_greedy(hf, output.prompt_token_ids, NEW_TOKENS)
        assert output.outputs[0].token_ids == expected, output.prompt
    assert len({len(o.prompt_token_ids) for o in outputs}) == len(PROMPTS)
    assert outputs[0].outputs[0].text.startswith("The capital of France is Paris.")
