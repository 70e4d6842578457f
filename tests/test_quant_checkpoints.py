"""Quantized checkpoints load into the model and run as their dequantized weights do.

compressed-tensors writes its own formats here (the library LLM Compressor saves with): a tiny
random Llama is quantized with its presets (W4A16 symmetric and asymmetric, FP8_DYNAMIC,
FP8_BLOCK), compressed and saved; the reference is the same HF model with the library's own
decompressed weights (and, for FP8, its activations rounded to e4m3 per token or token group).
Bad checkpoints (a missing or mis-shaped scale, inconsistent configs) fail at load, naming the
tensor or the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from test_model_vs_hf import metadata
from test_quant_layers import per_token_fp8

from asyncllm.attention.torch_backend import TorchAttentionBackend
from asyncllm.config import EngineArgs, ModelConfig
from asyncllm.layers.quantization import get_quantization_config
from asyncllm.models.loader import load_model

GROUP = 32
CONFIG = dict(
    vocab_size=211,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(**CONFIG)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _observed_range(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max of each group compressed-tensors keeps one scale for."""
    if args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    bn, bk = args.block_structure
    g = w.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))
    return g.amin((1, 3)), g.amax((1, 3))


def write_compressed(preset: str, path: Path) -> transformers.LlamaForCausalLM:
    """Save a compressed-tensors checkpoint of tiny_llama() quantized with preset; returns the
    model holding the library's decompressed weights."""
    model = tiny_llama()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights.group_size:
        scheme.weights.group_size = GROUP
    if scheme.weights.block_structure:
        scheme.weights.block_structure = [GROUP, GROUP]
        scheme.input_activations.group_size = GROUP
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            args = module.quantization_scheme.weights
            scale, zero = calculate_qparams(*_observed_range(module.weight.data, args), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    compressor.decompress_model(model)
    return model


def load_ours(path: Path, quantization: str | None = None, dtype: str = "auto") -> torch.nn.Module:
    args = EngineArgs(model=str(path), device="cpu", quantization=quantization, dtype=dtype)
    return load_model(ModelConfig.from_args(args), TorchAttentionBackend())


@torch.inference_mode()
def our_logits(
    model: torch.nn.Module, ids: torch.Tensor, cache_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    blocks = -(-len(ids) // 4)
    caches = [
        torch.zeros(spec.shape(blocks, 4), dtype=cache_dtype) for spec in model.kv_cache_specs
    ]
    meta = metadata([(0, len(ids))], [list(range(blocks))])
    hidden = model(ids, torch.arange(len(ids)), caches, meta)
    return model.compute_logits(hidden)


@torch.inference_mode()
def reference_logits(
    model: transformers.PreTrainedModel, ids: torch.Tensor, group: int | None
) -> torch.Tensor:
    """The HF model's logits with every quantized Linear's input rounded to FP8 per token (per
    token and group of `group` features), or as is when group is 0."""
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and group != 0:
            hooks.append(
                module.register_forward_pre_hook(lambda m, args: (_fp8_input(args[0], group),))
            )
    try:
        return model(ids[None]).logits[0]
    finally:
        for hook in hooks:
            hook.remove()


def _fp8_input(x: torch.Tensor, group: int | None) -> torch.Tensor:
    if group is None:
        return per_token_fp8(x)
    return torch.cat([per_token_fp8(part) for part in x.split(group, dim=-1)], dim=-1)


IDS = torch.randint(0, CONFIG["vocab_size"], (29,), generator=torch.Generator().manual_seed(3))
# preset -> FP8 activation groups of the reference: 0 none, None per token, else per group
PRESETS = {"W4A16": 0, "W4A16_ASYM": 0, "FP8_DYNAMIC": None, "FP8_BLOCK": GROUP}


@pytest.mark.parametrize("preset", PRESETS)
def test_compressed_tensors_checkpoint_runs_as_its_decompressed_weights(preset, tmp_path) -> None:
    hf = write_compressed(preset, tmp_path)
    ours = load_ours(tmp_path)
    expected = reference_logits(hf.double(), IDS, PRESETS[preset]).float()
    # rounding activations to e4m3 is a step function: a float32 difference of an ulp before
    # it (our fused CPU norm and rotary against HF's ops) moves an activation by a whole e4m3
    # step now and then, the logits by up to 3.7e-4 here (26 and 96 of 6,119 past 1e-4)
    atol = 1e-4 if PRESETS[preset] == 0 else 1e-3
    torch.testing.assert_close(our_logits(ours, IDS), expected, rtol=1e-4, atol=atol)


@pytest.fixture
def fp8_checkpoint(tmp_path: Path) -> Path:
    write_compressed("FP8_DYNAMIC", tmp_path)
    return tmp_path


def _edit_tensors(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_a_missing_scale_fails_at_load_naming_it(fp8_checkpoint: Path) -> None:
    _edit_tensors(fp8_checkpoint, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale"))
    with pytest.raises(
        ValueError, match=r"lacks .*layers\.1\.self_attn\.qkv_proj\.weight_scale\[1\]"
    ):
        load_ours(fp8_checkpoint)


def test_a_wrong_shape_scale_fails_at_load_naming_it(fp8_checkpoint: Path) -> None:
    name = "model.layers.0.mlp.down_proj.weight_scale"
    _edit_tensors(fp8_checkpoint, lambda t: t.update({name: t[name][:64]}))
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale.*\(64, 1\).*\(128, 1\)"):
        load_ours(fp8_checkpoint)


def _edit_config(path: Path, edit) -> None:
    file = path / "config.json"
    config = json.loads(file.read_text())
    edit(config["quantization_config"])
    file.write_text(json.dumps(config))


def test_inconsistent_configs_fail_naming_the_field(fp8_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="disagrees .*quant_method 'compressed-tensors'"):
        load_ours(fp8_checkpoint, quantization="fp8")
    _edit_config(
        fp8_checkpoint, lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=6)
    )
    with pytest.raises(ValueError, match=r"quantization_config\.num_bits is 6"):
        load_ours(fp8_checkpoint)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"bits": 4}, "quant_method is missing"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"\.bits is 8"),
        ({"quant_method": "gptq", "bits": 4}, r"\.group_size is missing"),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            r"\.version is 'gemv'",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"\.weight_block_size must be two"),
        ({"quant_method": "fp8", "activation_scheme": "none"}, r"\.activation_scheme is 'none'"),
    ],
)
def test_unsupported_quantization_configs_name_the_field(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_quantization_config(config, None)


def test_only_fp8_and_int8_quantize_at_load() -> None:
    assert get_quantization_config(None, None) is None
    assert get_quantization_config(None, "int8").name == "int8"
    with pytest.raises(ValueError, match="only 'fp8' and 'int8' quantize at load"):
        get_quantization_config(None, "awq")


@pytest.mark.parametrize("mode", ["fp8", "int8", "gptq"])
def test_an_engine_runs_dummy_quantized_weights(mode: str, tmp_path: Path) -> None:
    """bench/quant.py's set-up on a tiny shape: dummy weights, quantized at load or packed."""
    from asyncllm import LLM, SamplingParams

    config = tiny_llama().config.to_dict()
    if mode == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(
        model=str(tmp_path),
        load_format="dummy",
        device="cpu",
        quantization=None if mode == "gptq" else mode,
    )
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
