"""EAGLE, EAGLE-3 and Medusa heads on a CUDA device (Triton attention, the verify steps under
CUDA graphs, async scheduling on): the tokens of decoding without drafts."""

import pytest
import torch
from test_spec_eagle_support import NUM_HEADS, spec_stats, write_heads, write_target

from asyncllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# float32: the verify step's shapes round differently from a decode step's in bf16
KWARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory=1 << 28)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def plain(target_dir):
    return LLM(model=str(target_dir), **KWARGS)


def prompts(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 32, (5 + 7 * i,), generator=gen).tolist()}
            for i in range(n)]  # fmt: skip


def tokens(llm: LLM, n: int, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(n), params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_heads_give_the_same_tokens_on_the_gpu(target_dir, plain, tmp_path, method):
    head_dir = write_heads(method, tmp_path)
    config = {"method": method, "model": str(head_dir), "num_speculative_tokens": NUM_HEADS}
    spec = LLM(model=str(target_dir), **KWARGS, speculative_config=config)
    assert spec.config.async_scheduling
    for settings in [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=3)]:
        params = SamplingParams(max_tokens=48, ignore_eos=True, **settings)
        for n in (1, 8):
            assert tokens(spec, n, params) == tokens(plain, n, params)
    assert spec_stats(spec).num_draft_tokens > 0
