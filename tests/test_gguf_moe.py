"""GGUF files of tiny random Mixtral, Qwen3-MoE and DeepSeek-V2 models, written as llama.cpp's
converter writes them (merged experts, Mixtral's Q/K rows permuted, DeepSeek's kv_b split into
k_b and v_b) and as its older versions did (Mixtral's experts one tensor each, DeepSeek's kv_b
whole), converted and loaded, against Hugging Face transformers on the same weights."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize, quantize
from test_engine_matches_hf import hf_greedy
from test_gguf_convert import add_synthetic_tokenizer, llama_cpp_permute, synthetic_vocab
from test_moe_models import CONFIGS, DEEPSEEK, TINY, YARN, kv_caches, metadata

from asyncllm import LLM, SamplingParams
from asyncllm.attention.torch_backend import TorchAttentionBackend
from asyncllm.model_files.gguf_convert import (
    CACHE_ENV_VAR,
    WeightsFormat,
    byte_level_pre_tokenizer,
    convert_gguf,
)
from asyncllm.model_files.gguf_moe import moe_config
from asyncllm.models.loader import iter_safetensors
from asyncllm.models.registry import get_model_class

VOCAB = len(synthetic_vocab())
Q8_0 = gguf.GGMLQuantizationType.Q8_0
NEW_TOKENS = 6
MODELS = {
    "mixtral": ("llama", CONFIGS["mixtral"][0], CONFIGS["mixtral"][1]),
    # before April 2024 llama.cpp wrote Mixtral's experts one tensor each
    "mixtral_legacy": ("llama", CONFIGS["mixtral"][0], CONFIGS["mixtral"][1]),
    # llama.cpp's qwen3moe routes every layer
    "qwen3_moe": (
        "qwen3moe",
        transformers.Qwen3MoeConfig,
        dict(
            CONFIGS["qwen3_moe_dense_layer"][1],
            mlp_only_layers=[],
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=64
            ),
        ),
    ),
    # llama.cpp keeps one yarn mscale, so mscale and mscale_all_dim are equal (as in V2-Lite)
    "deepseek_v2": (
        "deepseek2",
        transformers.DeepseekV2Config,
        dict(
            DEEPSEEK,
            q_lora_rank=24,
            n_group=3,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
        ),
    ),
    # V2-Lite as llama.cpp wrote it before its MLA rewrite: kv_b whole, per-head key/value
    # lengths, no expert groups
    "deepseek_v2_lite_legacy": (
        "deepseek2",
        transformers.DeepseekV2Config,
        dict(DEEPSEEK, q_lora_rank=None, rope_parameters=YARN),
    ),
}


@dataclass
class Tiny:
    arch: str  # the GGUF's general.architecture
    hf: transformers.PreTrainedModel
    legacy: bool  # llama.cpp's older layout: split experts (Mixtral), kv_b whole (DeepSeek)


def make_tiny(name: str) -> Tiny:
    arch, config_class, extra = MODELS[name]
    config = config_class(**{**TINY, **extra, "vocab_size": VOCAB}, bos_token_id=1, eos_token_id=2)
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return Tiny(arch, hf.eval(), name.endswith("_legacy"))


def quantize_experts(hf: transformers.PreTrainedModel) -> None:
    """Round each gate_up_proj through Q8_0, so that HF runs the weights the GGUF holds."""
    with torch.no_grad():
        for module_name, param in hf.named_parameters():
            if module_name.endswith("experts.gate_up_proj"):
                q = quantize(param.numpy(), Q8_0)
                param.copy_(torch.from_numpy(dequantize(q, Q8_0)))


def write_metadata(
    writer: gguf.GGUFWriter, config: transformers.PretrainedConfig, legacy: bool
) -> None:
    """The fields llama.cpp's converter writes for these configs."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type == "mixtral":
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_expert_count(config.num_local_experts)
    elif config.model_type == "qwen3_moe":
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_expert_count(config.num_experts)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    else:
        write_deepseek_metadata(writer, config, legacy)
    if config.rope_parameters.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(
            config.rope_parameters["original_max_position_embeddings"]
        )
    pre = "deepseek-llm" if config.model_type == "deepseek_v2" else "smollm"
    add_synthetic_tokenizer(writer, synthetic_vocab(), pre)


def write_deepseek_metadata(
    writer: gguf.GGUFWriter, config: transformers.PretrainedConfig, legacy: bool
) -> None:
    writer.add_head_count_kv(1)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    if legacy:
        writer.add_key_length(config.qk_nope_head_dim + config.qk_rope_head_dim)
        writer.add_value_length(config.v_head_dim)
    else:
        writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
        writer.add_value_length(config.kv_lora_rank)
        writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
        writer.add_value_length_mla(config.v_head_dim)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    writer.add_rope_scaling_yarn_log_mul(0.1 * config.rope_parameters["mscale_all_dim"])


def gguf_tensors(tiny: Tiny) -> dict[str, np.ndarray]:
    """HF's state dict under llama.cpp's names and layout, through the gguf package's own map."""
    arch, config = tiny.arch, tiny.hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tensors: dict[str, np.ndarray] = {}

    def add(hf_name: str, tensor: np.ndarray) -> None:
        tensors[names.get_name(hf_name.removesuffix(".weight")) + ".weight"] = tensor

    for hf_name, param in tiny.hf.state_dict().items():
        tensor = param.numpy()
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "llama" and ".q_proj." in hf_name:
            tensor = llama_cpp_permute(tensor, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            tensor = llama_cpp_permute(tensor, config.num_key_value_heads)
        if hf_name.endswith("experts.gate_up_proj"):
            gate, up = np.split(tensor, 2, axis=1)
            add(hf_name.replace("gate_up_proj", "gate_proj"), gate)
            add(hf_name.replace("gate_up_proj", "up_proj"), up)
        elif hf_name.endswith("kv_b_proj.weight") and not tiny.legacy:
            heads, nope = config.num_attention_heads, config.qk_nope_head_dim
            kv_b = tensor.reshape(heads, nope + config.v_head_dim, -1)
            add(hf_name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].swapaxes(1, 2))
            add(hf_name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:])
        else:
            add(hf_name, tensor)
    return split_experts(tensors) if tiny.legacy and arch == "llama" else tensors


def split_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Mixtral as llama.cpp wrote it before April 2024: blk.N.ffn_gate.E, one per expert."""
    split = {}
    for name, tensor in tensors.items():
        if name.endswith("_exps.weight"):
            stem = name.removesuffix("_exps.weight")
            split |= {f"{stem}.{e}.weight": expert for e, expert in enumerate(tensor)}
        else:
            split[name] = tensor
    return split


def write_gguf(path: Path, tiny: Tiny, **replace: np.ndarray | None) -> Path:
    """`replace`: GGUF tensor name -> array to write instead (None: leave the tensor out)."""
    writer = gguf.GGUFWriter(path, tiny.arch)
    write_metadata(writer, tiny.hf.config, tiny.legacy)
    for name, tensor in {**gguf_tensors(tiny), **replace}.items():
        if tensor is None:
            continue
        if re.fullmatch(r"blk\.\d+\.ffn_(gate|up)(_exps|\.\d+)\.weight", name):
            writer.add_tensor(name, quantize(tensor, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_ours(folder: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(folder)
    ours = get_model_class(config)(config, TorchAttentionBackend()).eval()
    loaded = ours.load_weights(iter_safetensors(folder))
    assert loaded == {name for name, _ in ours.named_parameters()}
    return ours


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request, tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    tiny = make_tiny(request.param)
    quantize_experts(tiny.hf)
    root = tmp_path_factory.mktemp(request.param)
    folder = convert_gguf(write_gguf(root / "tiny.gguf", tiny), cache_root=root / "cache")
    return tiny.hf, folder


def our_logits(folder: Path) -> torch.Tensor:
    ours = load_ours(folder)
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(1))
    hidden = ours(ids, torch.arange(21), kv_caches(ours), metadata([(0, 21)], [list(range(6))]))
    return ours.compute_logits(hidden)


@torch.inference_mode()
def test_logits_match_hf(converted: tuple[transformers.PreTrainedModel, Path]) -> None:
    hf, folder = converted
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(1))
    expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(our_logits(folder), expected, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_sharded_conversion_gives_the_same_logits(
    converted: tuple[transformers.PreTrainedModel, Path],
) -> None:
    """The stacked experts (and DeepSeek's joined kv_b) streamed into 16 KiB shards."""
    folder = converted[1]
    root = folder.parents[2]  # <root>/cache/gguf/<folder>
    sharded = convert_gguf(
        root / "tiny.gguf", cache_root=root / "cache", weights=WeightsFormat(max_shard_bytes=2**14)
    )
    assert len(list(sharded.glob("*.safetensors"))) > 3
    assert (sharded / "model.safetensors.index.json").is_file()
    assert torch.equal(our_logits(sharded), our_logits(folder))


def test_config_comes_from_metadata(converted: tuple[transformers.PreTrainedModel, Path]) -> None:
    hf, folder = converted
    config = transformers.AutoConfig.from_pretrained(folder)
    keys = {
        "mixtral": ["num_local_experts", "num_experts_per_tok", "intermediate_size"],
        "qwen3_moe": ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "head_dim"],
        "deepseek_v2": [
            *("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "q_lora_rank"),
            *("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "first_k_dense_replace"),
            *("n_group", "topk_group", "topk_method", "num_key_value_heads"),
        ],
    }[hf.config.model_type]
    for key in [*keys, "architectures", "hidden_size", "num_hidden_layers", "tie_word_embeddings"]:
        assert getattr(config, key) == getattr(hf.config, key), key
    assert config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)


def test_deepseek_pre_tokenizer_splits_as_its_regexes() -> None:
    """DeepSeek-LLM's splits, each on the pieces the one before left: newlines, letters (the
    Kelvin sign is one, yet the later CJK range U+0800-U+4E00 takes it), punctuation (whose
    `:-~` holds the ASCII letters, so a Greek letter before them parts), trailing spaces, CJK,
    digits."""
    split = byte_level_pre_tokenizer("deepseek-llm")
    text = "Hello, 世界 123\n\u212aelvin Ωmega  "
    pieces = [text[a:b] for _, (a, b) in split.pre_tokenize_str(text)]
    assert pieces == [
        "Hello",
        ",",
        " ",
        "世界",
        " ",
        "123",
        "\n",
        "\u212a",
        "elvin",
        " Ω",
        "mega",
        "  ",
    ]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_missing_expert_tensor_is_named(name: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", make_tiny(name), **{"blk.1.ffn_up_exps.weight": None})
    with pytest.raises(ValueError, match=r"lacks the expert tensor blk\.1\.ffn_up_exps\.weight"):
        convert_gguf(path, cache_root=tmp_path / "cache")


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v2"])
def test_misshaped_expert_tensor_is_named(name: str, tmp_path: Path) -> None:
    tiny = make_tiny(name)
    down = gguf_tensors(tiny)["blk.2.ffn_down_exps.weight"]
    transposed = {"blk.2.ffn_down_exps.weight": down.swapaxes(1, 2)}
    path = write_gguf(tmp_path / "t.gguf", tiny, **transposed)
    with pytest.raises(ValueError, match=r"blk\.2\.ffn_down_exps\.weight has shape"):
        convert_gguf(path, cache_root=tmp_path / "cache")


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v2"])
def test_engine_serves_the_gguf_as_hf_greedy(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The .gguf path itself, through the engine (its loader and KV cache), batched."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    tiny = make_tiny(name)
    quantize_experts(tiny.hf)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (5 + 4 * i,), generator=gen).tolist() for i in range(3)]
    llm = LLM(model=str(write_gguf(tmp_path / "tiny.gguf", tiny)), max_model_len=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(tiny.hf, prompt, NEW_TOKENS)


def test_split_expert_file_missing_an_expert_is_named(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "t.gguf", make_tiny("mixtral_legacy"), **{"blk.2.ffn_down.3.weight": None}
    )
    with pytest.raises(ValueError, match=r"blk\.2\.ffn_down\.3\.weight is missing"):
        convert_gguf(path, cache_root=tmp_path / "cache")


def test_sigmoid_gated_deepseek_is_refused() -> None:
    """DeepSeek-V3's files share the deepseek2 arch; their sigmoid routing is not V2's."""
    with pytest.raises(ValueError, match="sigmoid expert gating"):
        moe_config("deepseek2", {"expert_gating_func": 2}, {})
