"""Medusa heads (Cai et al., 2024): head i reads the target's final hidden state at t through
residual blocks (x + silu(W x + b)) and its own lm_head, and guesses token t+2+i: the tokens
after the one the target samples at t. The layout is vLLM's (blocks.i.layers.j, lm_heads.i);
the Medusa authors' (i.j.linear, i.num_layers) is read too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.linear import LoadedWeight, ReplicatedLinear, default_weight_loader
from asyncllm.layers.vocab_parallel_embedding import ParallelLMHead

_AUTHORS_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.")
_AUTHORS_LM_HEAD = re.compile(r"^(\d+)\.(\d+)\.weight$")


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int  # residual blocks per head
    bias: bool
    head_vocab_size: int  # below vocab_size where token_map lists the heads' tokens

    @classmethod
    def from_json(cls, raw: dict) -> MedusaConfig:
        """vLLM's keys (num_heads, num_hidden_layers, medusa_fc_bias, truncated_vocab_size)
        or the Medusa authors' (medusa_num_heads, medusa_num_layers)."""
        num_heads = raw.get("num_heads", raw.get("medusa_num_heads"))
        if not num_heads:
            raise ValueError("speculative model: the Medusa config names no num_heads")
        try:
            vocab_size = raw["vocab_size"]
            return cls(
                hidden_size=raw["hidden_size"],
                vocab_size=vocab_size,
                num_heads=num_heads,
                num_layers=raw.get("num_hidden_layers", raw.get("medusa_num_layers", 1)),
                bias=bool(raw.get("medusa_fc_bias", False)),
                head_vocab_size=raw.get("truncated_vocab_size") or vocab_size,
            )
        except KeyError as e:
            raise ValueError(f"speculative model: the Medusa config lacks {e.args[0]}") from e


class _ResidualBlock(nn.Module):
    def __init__(self, config: MedusaConfig, prefix: str) -> None:
        super().__init__()
        size = config.hidden_size
        self.layers = nn.ModuleList(
            ReplicatedLinear(size, size, config.bias, prefix=f"{prefix}.layers.{j}")
            for j in range(config.num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, tensor_names: set[str]) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            _ResidualBlock(config, f"blocks.{i}") for i in range(config.num_heads)
        )
        self.lm_heads = nn.ModuleList(
            ParallelLMHead(config.head_vocab_size, config.hidden_size)
            for _ in range(config.num_heads)
        )
        self.token_map = None
        if "token_map" in tensor_names:
            ids = torch.zeros(config.head_vocab_size, dtype=torch.int64)
            self.token_map = nn.Parameter(ids, requires_grad=False)

    def draft_token_ids(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[R, num_heads]: the first num_heads heads' greedy guesses, as target ids."""
        guesses = [
            lm_head(block(hidden)).argmax(dim=-1)
            for block, lm_head in zip(self.blocks[:num_heads], self.lm_heads[:num_heads])
        ]
        ids = torch.stack(guesses, dim=1)
        return ids if self.token_map is None else self.token_map[ids]

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self.param_name(name.removeprefix("medusa_heads."))
            if name not in params:
                raise ValueError(f"speculative model: tensor {name!r} has no place in the heads")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded

    def param_name(self, name: str) -> str:
        """The Medusa authors' head i is Sequential(blocks..., lm_head)."""
        if match := _AUTHORS_BLOCK.match(name):
            head, layer = match.groups()
            return f"blocks.{head}.layers.{layer}." + name[match.end() :]
        if (match := _AUTHORS_LM_HEAD.match(name)) and int(match[2]) == self.config.num_layers:
            return f"lm_heads.{match[1]}.weight"
        return name
