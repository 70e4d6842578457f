"""FP8 at load on the MoE models: their attention projections are quantized (DeepSeek-V2's
kv_b_proj, which the attention reads as a matrix, is not), the experts and routers are not; the
quantized model stays close to the unquantized one. An FP8 KV cache is refused for MLA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_moe_models import (
    CONFIGS,
    DEVICE,
    TINY,
    VOCAB,
    kv_caches,
    make_pair,
    metadata,
    tokens,
)

from asyncllm import LLM
from asyncllm.attention.torch_backend import TorchAttentionBackend
from asyncllm.layers.linear import LinearBase, process_weights_after_loading
from asyncllm.layers.quantization import get_quantization_config
from asyncllm.layers.quantization.base import UnquantizedLinearMethod
from asyncllm.layers.quantization.fp8 import Fp8LinearMethod
from asyncllm.models.registry import get_model_class

ATTENTION = {
    "mixtral": ["qkv_proj", "o_proj"],
    "deepseek_v2_lite_yarn": ["q_proj", "kv_a_proj_with_mqa", "o_proj"],
    "deepseek_v2_grouped_topk": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
}


@pytest.mark.parametrize("name", ATTENTION)
@torch.inference_mode()
def test_fp8_at_load_quantizes_the_attention_only(name: str) -> None:
    hf, ours = make_pair(name)
    config = hf.config
    with torch.device(DEVICE):
        quantized = get_model_class(config)(
            config, TorchAttentionBackend(), get_quantization_config(None, "fp8")
        ).eval()
    quantized.load_weights(hf.state_dict().items())
    linears = {n: m for n, m in quantized.named_modules() if isinstance(m, LinearBase)}
    assert [u for m in linears.values() for u in m.unloaded()] == []
    process_weights_after_loading(quantized)

    for module_name, module in linears.items():
        fp8 = module_name.rpartition(".")[2] in ATTENTION[name]
        expected = Fp8LinearMethod if fp8 else UnquantizedLinearMethod
        assert type(module.quant_method) is expected, module_name

    ids = tokens(torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(2)))
    positions = tokens(torch.arange(21))
    meta = metadata([(0, 21)], [list(range(6))])
    logits = [m.compute_logits(m(ids, positions, kv_caches(m), meta)) for m in (ours, quantized)]
    error = (logits[1] - logits[0]).norm() / logits[0].norm()
    assert 0 < error < 0.05


def test_an_fp8_kv_cache_is_refused_for_latent_attention(tmp_path: Path) -> None:
    config_class, extra = CONFIGS["deepseek_v2_lite_yarn"]
    config = config_class(**{**TINY, **extra})
    config.architectures = ["DeepseekV2ForCausalLM"]
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="latent cache of an MLA model"):
        LLM(model=str(tmp_path), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64)
