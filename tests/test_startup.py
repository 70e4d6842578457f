"""Start-up's budget: what `import asyncllm.serve` pulls in before the port is bound, and the
CPU model's embedding read from its checkpoint's pages instead of a copy."""

import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from asyncllm.attention.torch_backend import TorchAttentionBackend
from asyncllm.config import EngineArgs, ModelConfig
from asyncllm.models.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
# optional dependencies and heavy modules the default CPU server never needs at import
NOT_AT_IMPORT = ("ray", "xgrammar", "openai", "playwright", "compressed_tensors", "sympy", "triton")


def test_importing_the_server_leaves_the_optional_dependencies_out() -> None:
    code = (
        "import json, sys; import asyncllm.serve; "
        f"print(json.dumps([m for m in {NOT_AT_IMPORT!r} if m in sys.modules]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout.splitlines()[-1]) == []


def mapped_file(address: int) -> str | None:
    """The file this process maps at address, from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, _, _, _, *path = line.split()
        start, end = (int(bound, 16) for bound in span.split("-"))
        if start <= address < end:
            return path[0] if path else None
    return None


def test_the_cpu_embedding_reads_its_rows_from_the_checkpoint_file(tiny_model_dir) -> None:
    config = ModelConfig.from_args(EngineArgs(model=str(tiny_model_dir), device="cpu"))
    model = load_model(config, TorchAttentionBackend())
    checkpoint = tiny_model_dir / "model.safetensors"
    weight = model.embed_tokens.weight
    expected = load_file(checkpoint)["model.embed_tokens.weight"]
    torch.testing.assert_close(weight, expected, rtol=0, atol=0)
    assert mapped_file(weight.data_ptr()) == str(checkpoint.resolve())
    # the tied lm_head keeps its own packed copy and gives the same logits as the embedding
    hidden = torch.randn(3, expected.shape[1])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ expected.T)


def test_a_converted_gguf_config_reads_as_its_model_config_class_would(default_model_dir) -> None:
    """Read without LlamaConfig (whose import pulls in torch.distributed.tensor), the config the
    converter wrote gives every field the model reads as LlamaConfig does."""
    config = ModelConfig.from_args(EngineArgs(model=str(default_model_dir), device="cpu"))
    reference = transformers.AutoConfig.from_pretrained(default_model_dir)
    assert type(config.hf_config) is not type(reference)
    for name in (
        "model_type",
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "vocab_size",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(config.hf_config, name) == getattr(reference, name), name
