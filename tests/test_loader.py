"""Loading weights: sharded safetensors with an index, dummy weights, and missing tensors."""

import json

import pytest
import transformers

from asyncllm import LLM, SamplingParams


def greedy(model: str, **kwargs) -> list[int]:
    llm = LLM(model=model, max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return (
        llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model_dir, tmp_path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    assert greedy(str(tmp_path)) == greedy(str(tiny_model_dir))


def test_dummy_weights_need_only_a_config(tiny_model_dir, tmp_path) -> None:
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    tokens = greedy(str(tmp_path), load_format="dummy")
    assert len(tokens) == 6


def test_a_checkpoint_missing_tensors_is_refused(tiny_model_dir, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(tiny_model_dir / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="norm.weight"):
        LLM(model=str(tmp_path))


def test_a_missing_shard_of_a_fused_layer_is_refused(tiny_model_dir, tmp_path) -> None:
    """k_proj gone: qkv_proj's q and v shards are there, so only its shard 1 is missing."""
    from safetensors.torch import load_file, save_file

    weights = load_file(tiny_model_dir / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight\[1\]"):
        LLM(model=str(tmp_path))


def test_dummy_weights_of_a_quantized_model(tiny_model_dir, tmp_path) -> None:
    """Packed int4 words, scales and g_idx filled so that the model runs."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert len(greedy(str(tmp_path), load_format="dummy")) == 6
