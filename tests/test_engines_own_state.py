"""Engines own all their state: two alive in one process, or one built after another is gone,
each give what they give alone (on the GPU with CUDA graphs: tests/test_gpu_engine.py)."""

import gc

from asyncllm import LLM, SamplingParams

PROMPTS = [
    {"prompt_token_ids": list(range(100 + k, 100 + k + n))} for k, n in enumerate((3, 40, 9))
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True, presence_penalty=0.5),
    SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=6, ignore_eos=True),
]
SMALL = {"max_num_seqs": 2, "max_num_batched_tokens": 32}
LARGE = {"max_num_seqs": 4, "max_num_batched_tokens": 64}


def build(path, limits: dict) -> LLM:
    return LLM(model=str(path), max_model_len=256, **limits)


def tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_two_engines_alive_at_once_give_what_each_gives_alone(tiny_model_dir) -> None:
    alone = {}
    for name, limits in (("small", SMALL), ("large", LARGE)):
        alone[name] = tokens(build(tiny_model_dir, limits))
        gc.collect()
    small, large = build(tiny_model_dir, SMALL), build(tiny_model_dir, LARGE)
    assert tokens(large) == alone["large"]
    assert tokens(small) == alone["small"]
    assert tokens(large) == alone["large"]
    del small
    gc.collect()
    assert tokens(large) == alone["large"]
