"""Sampling defaults from a model's generation_config.json, as vLLM's `--generation-config` reads
them: `auto` takes the model folder's, `vllm` none (SamplingParams' own defaults), a path a
folder's or file's of its own; `--override-generation-config` is laid over the result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE_NAME = "generation_config.json"
# Hugging Face's names -> SamplingParams'; do_sample is not read, as vLLM does not read it
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(
    model_path: Path, source: str = "auto", overrides: str | dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams keyword arguments for the fields a request leaves out."""
    settings = {} if source == "vllm" else read_settings(model_path if source == "auto" else source)
    settings = {k: v for k, v in settings.items() if k in SAMPLING_KEYS and v is not None}
    settings.update(parse_overrides(overrides))
    return {SAMPLING_KEYS[k]: v for k, v in settings.items()}


def read_settings(path: str | Path) -> dict[str, Any]:
    """A folder's generation_config.json (none there: no settings) or the named JSON file."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / FILE_NAME
        if not path.is_file():
            return {}
    try:
        settings = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from e
    if not isinstance(settings, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object.")
    return settings


def parse_overrides(overrides: str | dict[str, Any] | None) -> dict[str, Any]:
    if overrides is None or overrides == "":
        return {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ValueError(f"override_generation_config is not valid JSON: {e}") from e
    if not isinstance(overrides, dict):
        raise ValueError("override_generation_config must be a JSON object.")
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f"override_generation_config: unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(SAMPLING_KEYS)}."
        )
    return dict(overrides)
