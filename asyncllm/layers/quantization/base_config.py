"""QuantizationConfig: one checkpoint's quantization settings, which layers they replace, and
the LinearMethodBase each replaced layer runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from torch import nn

from asyncllm.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod


class QuantizationConfig(ABC):
    name: ClassVar[str]

    def __init__(self, skipped: list[str] | None = None) -> None:
        self.skipped = list(skipped or [])

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """From a checkpoint's quantization_config; ValueError naming a bad field."""

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethodBase:
        """The method of a layer this config quantizes."""

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """lm_head and the checkpoint's skipped modules stay unquantized."""
        if prefix.split(".")[-1] == "lm_head" or self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        return self.linear_method(prefix)

    def is_skipped(self, prefix: str) -> bool:
        return any(prefix == s or prefix.startswith(s + ".") or s in prefix for s in self.skipped)


def field(
    config: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    """config[name], checked to be of kind; ValueError naming the field."""
    if name not in config:
        if default is ...:
            raise ValueError(f"quantization_config.{name} is missing")
        return default
    value = config[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, (int,))):
        raise ValueError(f"quantization_config.{name} has an unexpected value {value!r}")
    return value


def choice(config: dict[str, Any], name: str, allowed: tuple, default: Any = ...) -> Any:
    value = field(config, name, object, default)
    if value not in allowed:
        raise ValueError(
            f"quantization_config.{name} is {value!r}; supported: {', '.join(map(repr, allowed))}"
        )
    return value
