import json
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch_file
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncllm.model_files import gguf_convert
from asyncllm.model_files.gguf_convert import (
    CACHE_ENV_VAR,
    WeightsFormat,
    cached_folder,
    convert_gguf,
)
from asyncllm.model_files.model_path import (
    DEFAULT_MODEL_SAMPLING,
    DEFAULT_MODEL_WEIGHTS,
    default_gguf_path,
    resolve_model_path,
)

IM_END = 2
F32, F16, Q8_0 = (gguf.GGMLQuantizationType[t] for t in ("F32", "F16", "Q8_0"))


@pytest.fixture(scope="session")
def default_folder() -> Path:
    # the real cache: the conversion happens once, then every session reuses it
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_folder: Path):
    return AutoTokenizer.from_pretrained(default_folder)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
def test_default_model_answers_capital_of_france(default_folder: Path, default_tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(default_folder, torch_dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = default_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding
        prompt = prompt["input_ids"]
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    new_tokens = output[0, len(prompt) :].tolist()
    assert new_tokens[-1] == IM_END
    assert default_tokenizer.decode(new_tokens[:-1]) == "The capital of France is Paris."


def test_default_model_eos_is_im_end(default_folder: Path, default_tokenizer) -> None:
    assert read_json(default_folder / "config.json")["eos_token_id"] == IM_END
    assert read_json(default_folder / "generation_config.json")["eos_token_id"] == IM_END
    assert default_tokenizer.eos_token == "<|im_end|>"
    assert default_tokenizer.eos_token_id == IM_END


def test_default_model_carries_its_publishers_sampling(default_folder: Path) -> None:
    config = read_json(default_folder / "generation_config.json")
    assert config["temperature"] == 0.2 and config["top_p"] == 0.9
    assert config["max_new_tokens"] == DEFAULT_MODEL_SAMPLING["max_new_tokens"]


def test_default_model_ties_embeddings(default_folder: Path) -> None:
    config = read_json(default_folder / "config.json")
    assert config["tie_word_embeddings"] is True
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576


def test_digits_tokenize_individually(default_tokenizer) -> None:
    tokens = default_tokenizer.tokenize("In 2024 there were 12345 cats")
    digits = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digits == list("202412345")


def test_chat_template_comes_from_gguf(default_tokenizer) -> None:
    text = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_second_conversion_returns_cached_folder(default_folder: Path) -> None:
    start = time.perf_counter()
    folder = convert_gguf(
        default_gguf_path(), sampling=DEFAULT_MODEL_SAMPLING, weights=DEFAULT_MODEL_WEIGHTS
    )
    assert folder == default_folder
    assert time.perf_counter() - start < 2.0


def test_resolve_model_folder_returns_itself(default_folder: Path) -> None:
    assert resolve_model_path(str(default_folder)) == default_folder


def test_resolve_missing_path_is_value_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match="model path .*nope.gguf.* does not exist"):
        resolve_model_path(str(missing))


@pytest.mark.parametrize("name", ["empty_dir", "weights.bin"])
def test_resolve_non_model_is_value_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.mkdir() if name == "empty_dir" else path.write_bytes(b"")
    with pytest.raises(ValueError, match=f"model path .*{name}.* is not a Hugging Face model"):
        resolve_model_path(str(path))


def test_cache_dir_follows_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    assert cached_folder(default_gguf_path()).parent == tmp_path / "gguf"


# A tiny random llama written the way llama.cpp's converter writes one.

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e"]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    split = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def synthetic_vocab() -> list[str]:
    return SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he"]


def synthetic_hf_tensors(vocab_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {
        "model.embed_tokens.weight": (vocab_size, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (vocab_size, HIDDEN),
    }
    for i in range(LAYERS):
        prefix = f"model.layers.{i}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (HIDDEN,),
            f"{prefix}.post_attention_layernorm.weight": (HIDDEN,),
            f"{prefix}.self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            f"{prefix}.self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"{prefix}.self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            f"{prefix}.mlp.gate_proj.weight": (FFN, HIDDEN),
            f"{prefix}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"{prefix}.mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


def gguf_name(hf_name: str) -> str:
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    names |= {f".{hf}": f".{g}" for g, hf in gguf_convert._LAYER_TENSORS.items()}
    name = hf_name.replace("model.layers.", "blk.")
    for hf, g in names.items():
        name = name.replace(hf, g)
    return name


def add_synthetic_tokenizer(writer: gguf.GGUFWriter, vocab: list[str], pre: str = "smollm") -> None:
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(vocab) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(IM_END)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def add_synthetic_llama_metadata(writer: gguf.GGUFWriter, vocab: list[str]) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    add_synthetic_tokenizer(writer, vocab)


def write_synthetic_gguf(
    path: Path,
    tensors: dict[str, np.ndarray],
    vocab: list[str],
    matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
) -> None:
    """`matrix_type`: the type the 2-D tensors are stored in (the norms stay F32)."""
    writer = gguf.GGUFWriter(path, "llama")
    add_synthetic_llama_metadata(writer, vocab)
    for name, tensor in tensors.items():
        if ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, HEADS)
        elif ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, KV_HEADS)
        add_tensor(writer, gguf_name(name), tensor, matrix_type if tensor.ndim > 1 else F32)
    write_and_close(writer)


def add_tensor(
    writer: gguf.GGUFWriter, name: str, tensor: np.ndarray, kind: gguf.GGMLQuantizationType
) -> None:
    if kind == F16:
        writer.add_tensor(name, tensor.astype(np.float16))
    elif kind == F32:
        writer.add_tensor(name, tensor)
    else:
        writer.add_tensor(name, quantize(tensor, kind), raw_dtype=kind)


def write_and_close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def synthetic_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("synthetic") / "tiny.gguf"
    tensors = synthetic_hf_tensors(len(synthetic_vocab()))
    write_synthetic_gguf(path, tensors, synthetic_vocab())
    return path, tensors


@pytest.fixture(scope="module")
def synthetic_folder(synthetic_gguf: tuple[Path, dict[str, np.ndarray]]) -> Path:
    path = synthetic_gguf[0]
    return convert_gguf(path, cache_root=path.parent / "cache")


def test_synthetic_tensors_round_trip(
    synthetic_gguf: tuple[Path, dict[str, np.ndarray]], synthetic_folder: Path
) -> None:
    original = synthetic_gguf[1]
    converted = load_file(synthetic_folder / "model.safetensors")
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        assert converted[name].dtype == np.float32
        np.testing.assert_array_equal(converted[name], tensor, err_msg=name)


def test_synthetic_config_matches_metadata(synthetic_folder: Path) -> None:
    config = read_json(synthetic_folder / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (HIDDEN, LAYERS)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["intermediate_size"] == FFN and config["vocab_size"] == len(synthetic_vocab())
    assert config["rope_theta"] == 50000.0 and config["max_position_embeddings"] == 256
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "float32"


def test_synthetic_tokenizer_uses_merges(synthetic_folder: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(synthetic_folder)
    assert tokenizer.tokenize("the 42") == ["t", "he", "Ġ", "4", "2"]
    assert tokenizer.tokenize(" the") == ["Ġt", "he"]
    assert tokenizer.eos_token_id == IM_END


def test_interrupted_conversion_leaves_nothing(
    synthetic_gguf: tuple[Path, dict[str, np.ndarray]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupt(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "write_weights", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(synthetic_gguf[0], cache_root=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {
        name: tensor
        for file in sorted(folder.glob("*.safetensors"))
        for name, tensor in load_torch_file(file).items()
    }


@torch.inference_mode()
def test_sharded_conversion_loads_as_the_single_file(
    synthetic_gguf: tuple[Path, dict[str, np.ndarray]], synthetic_folder: Path
) -> None:
    """A small shard bound: several shards and Hugging Face's index, which transformers loads
    to the logits of the one-file conversion."""
    path, original = synthetic_gguf
    bound = 64 * 1024  # the embedding and lm_head (67 KB each) have a shard alone
    folder = convert_gguf(
        path, cache_root=path.parent / "cache", weights=WeightsFormat(max_shard_bytes=bound)
    )
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 3 and not (folder / "model.safetensors").exists()
    index = read_json(folder / "model.safetensors.index.json")
    assert set(index["weight_map"].values()) == {shard.name for shard in shards}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in original.values())
    for shard in shards:
        tensors = load_torch_file(shard)
        assert sum(t.nbytes for t in tensors.values()) <= bound or len(tensors) == 1
        assert all(index["weight_map"][name] == shard.name for name in tensors)
    ids = torch.randint(
        0, len(synthetic_vocab()), (1, 13), generator=torch.Generator().manual_seed(0)
    )
    logits = [
        AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32)(ids).logits
        for f in (synthetic_folder, folder)
    ]
    assert torch.equal(*logits)


@pytest.mark.parametrize(
    ("matrix_type", "dtype"),
    [(Q8_0, torch.bfloat16), (F16, torch.float16)],
)
def test_matrix_types_pick_the_dtype(
    matrix_type: gguf.GGMLQuantizationType, dtype: torch.dtype, tmp_path: Path
) -> None:
    """A quantized file converts to bfloat16 (torch's rounding of the dequantized values), an
    F16 one to float16 (exact); the F32 norms follow."""
    tensors = synthetic_hf_tensors(len(synthetic_vocab()))
    path = tmp_path / "typed.gguf"
    write_synthetic_gguf(path, tensors, synthetic_vocab(), matrix_type)
    folder = convert_gguf(path, cache_root=tmp_path / "cache")
    assert read_json(folder / "config.json")["torch_dtype"] == str(dtype).removeprefix("torch.")
    converted = folder_tensors(folder)
    assert converted.keys() == tensors.keys()
    for name, tensor in tensors.items():
        stored = stored_values(tensor, matrix_type if tensor.ndim > 1 else F32)
        expected = torch.from_numpy(stored).to(dtype)
        assert torch.equal(converted[name], expected), name


def stored_values(tensor: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """The float32 values the GGUF holds for `tensor` stored as `kind`."""
    if kind == F16:
        return tensor.astype(np.float16).astype(np.float32)
    if kind == F32:
        return tensor
    return dequantize(quantize(tensor, kind), kind)


def test_conversion_memory_stays_below_a_shard(tmp_path: Path) -> None:
    """Merged expert tensors several shards big (12 MiB as bf16, each gate_up_proj a 4 MiB
    shard alone; 24 MiB dequantized) convert with a traced peak (numpy's arrays included)
    below one shard: one expert at a time is dequantized, joined and written."""
    experts, inner, hidden, bound = 16, 128, 512, 4 * 2**20
    writer = gguf.GGUFWriter(tmp_path / "moe.gguf", "llama")
    add_synthetic_llama_metadata(writer, synthetic_vocab())
    rng = np.random.default_rng(0)
    shapes = {"gate": (inner, hidden), "up": (inner, hidden), "down": (hidden, inner)}
    for layer in range(LAYERS):
        for projection, shape in shapes.items():
            values = rng.standard_normal((experts, *shape), dtype=np.float32)
            add_tensor(writer, f"blk.{layer}.ffn_{projection}_exps.weight", values, Q8_0)
    write_and_close(writer)
    del writer, values
    tracemalloc.start()
    try:
        folder = convert_gguf(
            tmp_path / "moe.gguf",
            cache_root=tmp_path / "cache",
            weights=WeightsFormat(max_shard_bytes=bound),
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    shards = sorted(folder.glob("*.safetensors"))
    sizes = [shard.stat().st_size for shard in shards]
    assert len(shards) >= 3 and sum(sizes) > 3 * bound
    assert peak < bound, f"peak {peak / 2**20:.1f} MiB"
