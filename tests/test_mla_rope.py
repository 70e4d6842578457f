"""YaRN as DeepSeek-V2-Lite configures it, against Hugging Face's own computation."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from asyncllm.layers.rotary import build_cos_sin_cache, yarn_attention_factor, yarn_inv_freq
from asyncllm.models.shapes import SHAPES


@pytest.mark.parametrize("mscale_all_dim", [0.707, 1.0])
def test_yarn_matches_hf_at_deepseek_v2_lite_sizes(mscale_all_dim: float) -> None:
    shape = dict(SHAPES["deepseek-v2-lite"])
    shape["rope_scaling"] = dict(shape["rope_scaling"], mscale_all_dim=mscale_all_dim)
    config = transformers.DeepseekV2Config(**shape)
    scaling, theta = config.rope_parameters, config.rope_parameters["rope_theta"]
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    # HF computes in float32, we in float64: compare to float32's precision
    base = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(yarn_inv_freq(base, theta, scaling).float(), hf_inv_freq)
    assert yarn_attention_factor(scaling) == pytest.approx(hf_factor)
    positions = torch.tensor([0, 1, 2, 100])
    angles = positions[:, None].double() * hf_inv_freq.double()[None, :]
    expected = torch.cat([angles.cos(), angles.sin()], dim=-1) * hf_factor
    cache = build_cos_sin_cache(64, 4096, theta, scaling)
    torch.testing.assert_close(cache[positions].double(), expected, rtol=0, atol=1e-5)
