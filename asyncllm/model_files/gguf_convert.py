"""Convert a llama-architecture GGUF file (or a MoE one: model_files.gguf_moe) into a cached
Hugging Face model folder.

The folder holds config.json, generation_config.json (with the sampling settings the caller
recommends for the model, which a GGUF file does not carry), the tokenizer files (with the chat
template) and the weights as safetensors shards (model.safetensors, or shards with
model.safetensors.index.json past MAX_SHARD_BYTES), so everything downstream only ever loads Hugging
Face folders. The weights stream: one tensor (one expert of a stacked expert tensor) is dequantized
and written at a time, so converting a file of any size takes about that much memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from asyncllm.model_files.gguf_moe import (
    applies_llama_rope_permutation,
    check_expert_tensors,
    moe_config,
    moe_tensor_name,
    stack_split_sources,
)
from asyncllm.model_files.safetensors_shards import FORMATS, TensorSource, write_shards

# Bump when the folder layout or contents change, so stale cached folders are not reused.
# 3: the weights in the dtype weights_dtype picks, sharded past MAX_SHARD_BYTES.
CONVERTER_VERSION = 3
# Hugging Face's shard size bound is 5 GB; any bound does, the memory a conversion takes does
# not depend on it
MAX_SHARD_BYTES = 4 * 2**30
AUTO_DTYPE = "auto"
# config.json's mark of a config written whole here: every field the model reads is in it, so
# it is read without its model's config class (transformers' LlamaConfig import took 2.5 s of
# the server's start-up, most of it in torch.distributed.tensor, which it imports)
COMPLETE_CONFIG_KEY = "asyncllm_complete_config"
CACHE_ENV_VAR = "ASYNCLLM_CACHE_DIR"

_ARCHITECTURES = ("llama", "qwen3moe", "deepseek2")
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# llama.cpp's `tokenizer.ggml.pre` names, grouped by the split they stand for (llama-vocab.cpp).
_GPT2_PRE = {"gpt-2", "mpt", "olmo", "jais"}
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
# DeepSeek-LLM's (and V2's) letters, as code point ranges: written as characters, some of them
# (the Kelvin and Ohm signs, Greek with oxia) would not survive Unicode normalisation
_DEEPSEEK_LETTER_RANGES = """
0041-005A 0061-007A 00B5 00C0-00D6 00D8-00F6 00F8-01BA 01BC-01BF 01C4-0293 0295-02AF 0370-0373
0376 0377 037B-037D 037F 0386 0388-038A 038C 038E-03A1 03A3-03F5 03F7-0481 048A-052F 0531-0556
10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77 1D79-1D9A 1E00-1F15
1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE
1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115
2119-211D 2124 2126 2128 212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183 2184 2C00-2C7B
2C7E-2CE4 2CEB-2CEE 2CF2 2CF3 A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF
FB00-FB06 FB13-FB17 FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2
10CC0-10CF2 118A0-118DF 1E900-1E943
"""


def _character_class(ranges: str) -> str:
    def characters(item: str) -> str:
        return "-".join(chr(int(code, 16)) for code in item.split("-"))

    return "[" + "".join(characters(item) for item in ranges.split()) + "]"


# the pre-tokenizer names whose split is a sequence of regexes, each applied to the pieces the
# previous one left (DeepSeek-LLM's tokenizer.json: newlines, letters, punctuation, trailing
# spaces, CJK and Hangul, digits)
_REGEX_PRE = {
    "llama-bpe": (_LLAMA3_REGEX,),
    "qwen2": (_QWEN2_REGEX,),
    "stablelm2": (_QWEN2_REGEX,),
    "deepseek-llm": (
        r"[\r\n]",
        r"\s?" + _character_class(_DEEPSEEK_LETTER_RANGES) + "+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}+",
    ),
}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@dataclass(frozen=True)
class GGUFModelInfo:
    """The hyperparameters and special tokens a GGUF file declares."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str | None
    architecture: str = "llama"


@dataclass(frozen=True)
class WeightsFormat:
    """How the converted folder holds the weights."""

    dtype: str = AUTO_DTYPE  # a safetensors_shards.FORMATS key, or AUTO_DTYPE: weights_dtype's
    max_shard_bytes: int = MAX_SHARD_BYTES

    def __post_init__(self) -> None:
        if self.dtype != AUTO_DTYPE and self.dtype not in FORMATS:
            raise ValueError(f"dtype must be one of {AUTO_DTYPE}, {', '.join(FORMATS)}")


def convert_gguf(
    gguf_path: str | Path,
    cache_root: Path | None = None,
    sampling: dict[str, Any] | None = None,
    weights: WeightsFormat = WeightsFormat(),
) -> Path:
    """Return the Hugging Face folder for `gguf_path`, converting it on the first call.
    `sampling`: Hugging Face generation settings (temperature, top_p, max_new_tokens, ...) to
    write into its generation_config.json."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    target = cached_folder(gguf_path, cache_root, sampling, weights)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_hf_folder(gguf_path, staging, sampling or {}, weights)
        make_shareable(staging)
        staging.rename(target)
    except OSError:
        # another process finished the same conversion first: its folder is complete, keep it
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cache_dir(cache_root: Path | None = None) -> Path:
    root = cache_root or os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "asyncllm"
    return Path(root).expanduser()


def cached_folder(
    gguf_path: Path,
    cache_root: Path | None = None,
    sampling: dict[str, Any] | None = None,
    weights: WeightsFormat = WeightsFormat(),
) -> Path:
    """`<cache>/gguf/<stem>-<key>`; the key changes when the file is replaced or rewritten, or
    the sampling settings or the weights' format change."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}:v{CONVERTER_VERSION}"
    identity += f":{weights.dtype}:{weights.max_shard_bytes}"
    if sampling:
        identity += ":" + json.dumps(sampling, sort_keys=True)
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir(cache_root) / "gguf" / f"{gguf_path.stem}-{key}"


def make_shareable(folder: Path) -> None:
    # mkdtemp creates the folder private (0700); the cache may be shared by several users
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def write_hf_folder(
    gguf_path: Path, out: Path, sampling: dict[str, Any], weights: WeightsFormat
) -> None:
    reader = GGUFReader(gguf_path)
    info = read_model_info(reader)
    dtype = weights_dtype(reader) if weights.dtype == AUTO_DTYPE else weights.dtype
    config = moe_config(info.architecture, arch_metadata(reader, info), hf_config(info, dtype))
    if config["model_type"] != "llama":  # the MoE configs leave fields to their classes' defaults
        del config[COMPLETE_CONFIG_KEY]
    check_expert_tensors(tensor_shapes(reader), config)
    write_weights(reader, info, out, dtype, weights.max_shard_bytes)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {**generation_config(info), **sampling})
    write_tokenizer(reader, info, gguf_path, out)


def read_model_info(reader: GGUFReader) -> GGUFModelInfo:
    arch = field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}: {', '.join(_ARCHITECTURES)}")
    hidden = int(field(reader, f"{arch}.embedding_length"))
    heads = int(field(reader, f"{arch}.attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    return GGUFModelInfo(
        hidden_size=hidden,
        num_layers=int(field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        context_length=int(field(reader, f"{arch}.context_length")),
        vocab_size=vocab_size(reader, arch),
        tied_embeddings="output.weight" not in tensor_names,
        bos_token_id=optional_int(field(reader, "tokenizer.ggml.bos_token_id", None)),
        eos_token_ids=eos_token_ids(reader),
        pad_token_id=optional_int(field(reader, "tokenizer.ggml.padding_token_id", None)),
        chat_template=field(reader, "tokenizer.chat_template", None),
        architecture=arch,
    )


def arch_metadata(reader: GGUFReader, info: GGUFModelInfo) -> dict[str, Any]:
    """The file's `{arch}.` fields, prefix removed."""
    prefix = f"{info.architecture}."
    return {
        key.removeprefix(prefix): value.contents()
        for key, value in reader.fields.items()
        if key.startswith(prefix)
    }


def tensor_shapes(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    # GGUF lists a tensor's dimensions innermost first
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


_MISSING = object()


def field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    if key in reader.fields:
        return reader.fields[key].contents()
    if default is _MISSING:
        raise ValueError(f"GGUF file lacks the metadata field {key!r}")
    return default


def optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def vocab_size(reader: GGUFReader, arch: str) -> int:
    if f"{arch}.vocab_size" in reader.fields:
        return int(field(reader, f"{arch}.vocab_size"))
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    """The GGUF's end-of-sequence id, then its end-of-turn / end-of-message ids if distinct."""
    keys = (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    )
    ids = [int(reader.fields[k].contents()) for k in keys if k in reader.fields]
    return tuple(dict.fromkeys(ids))


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if moe := moe_tensor_name(gguf_name):
        return moe
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: it interleaves each head's two rotary halves,
    while Hugging Face's rotate_half expects the first half of the rows then the second."""
    half = weight.shape[0] // num_heads // 2
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


_FULL_PRECISION_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F64}
_HALF_TYPES = {GGMLQuantizationType.F16: "float16", GGMLQuantizationType.BF16: "bfloat16"}


def weights_dtype(reader: GGUFReader) -> str:
    """The dtype the folder holds the weights in, from the types of the file's matrices (its
    1-D norms are F32 in every llama.cpp file and say nothing):
    - float32 when a matrix is F32 (the publisher kept full precision; 16 bits would round it),
      or when F16 and BF16 matrices mix (neither holds the other);
    - float16 or bfloat16 when every matrix is that type: it holds them exactly;
    - bfloat16 for a quantized file: no 16-bit type holds its values (an f16 scale times an
      integer, plus an f16 minimum) exactly, and their quantization error is far above bf16's
      rounding (2^-9); bf16 has float32's range, and it is the dtype the engine serves in on a
      GPU, so loading rounds nothing again."""
    types = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    halves = types & set(_HALF_TYPES)
    if types & _FULL_PRECISION_TYPES or len(halves) > 1:
        return "float32"
    if types and types == halves:
        return _HALF_TYPES[halves.pop()]
    return "bfloat16"


def write_weights(
    reader: GGUFReader, info: GGUFModelInfo, out: Path, dtype: str, max_shard_bytes: int
) -> None:
    write_shards(list(weight_sources(reader, info).values()), out, dtype, max_shard_bytes)


def weight_sources(reader: GGUFReader, info: GGUFModelInfo) -> dict[str, TensorSource]:
    """Each Hugging Face tensor by name, as the GGUF tensors it is read from."""
    permuted = applies_llama_rope_permutation(info.architecture)
    sources: dict[str, TensorSource] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        heads = rotary_heads(tensor.name, info) if permuted else None
        shape = tuple(int(n) for n in reversed(tensor.shape))
        sources[name] = TensorSource(name, shape, partial(dequantized_chunks, tensor, heads))
    stack_split_sources(sources)
    return sources


def rotary_heads(gguf_name: str, info: GGUFModelInfo) -> int | None:
    """The head count whose rows llama.cpp permuted in this tensor (None: not a Q/K one)."""
    if gguf_name.startswith("blk.") and ".attn_q." in gguf_name:
        return info.num_heads
    if gguf_name.startswith("blk.") and ".attn_k." in gguf_name:
        return info.num_kv_heads
    return None


def dequantized_chunks(tensor: ReaderTensor, rotary: int | None) -> Iterator[np.ndarray]:
    """The tensor's float32 values; a merged expert tensor's one expert at a time.
    `rotary`: the head count whose Q/K row permutation to undo."""
    parts = tensor.data if len(tensor.shape) > 2 else [tensor.data]
    for part in parts:
        weight = dequantize(part, tensor.tensor_type).astype(np.float32, copy=False)
        yield weight if rotary is None else unpermute_rotary(weight, rotary)


def hf_config(info: GGUFModelInfo, dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": info.hidden_size,
        "intermediate_size": info.intermediate_size,
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": info.context_length,
        "rms_norm_eps": info.rms_norm_eps,
        # both spellings: transformers 5 reads rope_parameters, older readers rope_theta
        "rope_theta": info.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": info.rope_theta},
        "vocab_size": info.vocab_size,
        "tie_word_embeddings": info.tied_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": info.bos_token_id,
        "eos_token_id": one_or_list(info.eos_token_ids),
        "pad_token_id": info.pad_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        COMPLETE_CONFIG_KEY: True,
    }


def complete_config(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json when this converter wrote it (COMPLETE_CONFIG_KEY), else None."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return config if config.get(COMPLETE_CONFIG_KEY) is True else None


def generation_config(info: GGUFModelInfo) -> dict[str, Any]:
    config = {"bos_token_id": info.bos_token_id, "eos_token_id": one_or_list(info.eos_token_ids)}
    if info.pad_token_id is not None:
        config["pad_token_id"] = info.pad_token_id
    return config


def one_or_list(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_tokenizer(reader: GGUFReader, info: GGUFModelInfo, gguf_path: Path, out: Path) -> None:
    # imported here: transformers is slow to import and only a first conversion needs it
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    byte_level = field(reader, "tokenizer.ggml.model") == "gpt2"
    if byte_level:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(reader, info, tokens))
    else:
        # SentencePiece-style vocabularies carry no pre-tokenizer name; transformers converts them
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    special = {
        "bos_token": info.bos_token_id,
        "eos_token": info.eos_token_ids[0] if info.eos_token_ids else None,
        "unk_token": optional_int(field(reader, "tokenizer.ggml.unknown_token_id", None)),
        "pad_token": info.pad_token_id,
    }
    for name, token_id in special.items():
        if token_id is not None:
            setattr(tokenizer, name, tokens[token_id])
    tokenizer.model_max_length = info.context_length
    if info.chat_template:
        tokenizer.chat_template = info.chat_template
    tokenizer.save_pretrained(out)
    if byte_level:
        set_tokenizer_class(out / "tokenizer_config.json", "PreTrainedTokenizerFast")


def set_tokenizer_class(config_path: Path, name: str) -> None:
    # transformers 5 writes its own class name, which transformers 4 cannot load; this one both can
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = name
    write_json(config_path, config)


def byte_level_bpe(reader: GGUFReader, info: GGUFModelInfo, tokens: list[str]) -> Tokenizer:
    merges = [tuple(merge.split(" ", 1)) for merge in field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(field(reader, "tokenizer.ggml.pre", "gpt-2"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = bos_processor(reader, info, tokens)
    tokenizer.add_tokens(added_tokens(reader, tokens))
    return tokenizer


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The Hugging Face equivalent of llama.cpp's regex split for the GGUF's pre-tokenizer name."""
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _REGEX_PRE:
        return pre_tokenizers.Sequence(
            [
                *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _REGEX_PRE[pre]),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")


def bos_processor(
    reader: GGUFReader, info: GGUFModelInfo, tokens: list[str]
) -> processors.PostProcessor:
    if not field(reader, "tokenizer.ggml.add_bos_token", False) or info.bos_token_id is None:
        return processors.ByteLevel(trim_offsets=False)
    bos = tokens[info.bos_token_id]
    return processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B:1",
        special_tokens=[(bos, info.bos_token_id)],
    )


def added_tokens(reader: GGUFReader, tokens: list[str]) -> list[AddedToken]:
    """Control tokens become special added tokens, user-defined ones plain added tokens."""
    types = field(reader, "tokenizer.ggml.token_type", [])
    return [
        AddedToken(tokens[i], special=kind == _TOKEN_TYPE_CONTROL, normalized=False)
        for i, kind in enumerate(types)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
