"""SamplingMetadata: one step's sampling settings of the whole batch, as device tensors.

SamplingState builds it (asyncllm/sample/state.py, batch.py). Everything optional stays None
unless some request in the batch uses it. Sparse things (logit bias, banned tokens, allowed
tokens) travel as flat (row, token) pairs, and the penalties as the requests' token history
(kernels.sampling_rows.Penalties); the samplers apply them at those tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from asyncllm.sampling_params import SamplingParams
from kernels.sampling_rows import Penalties, RowKeys


class SamplingRequest(Protocol):
    """What the sampler reads from a request (asyncllm.request.Request has all of it)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    bad_words_token_ids: list[list[int]]


@dataclass
class TokenIndex:
    """Flat (row, token id) pairs."""

    rows: torch.Tensor  # int64 [K]
    token_ids: torch.Tensor  # int64 [K]
    _keys: torch.Tensor | None = field(default=None, repr=False)  # kept: a batch reuses them

    def keys(self, vocab_size: int) -> torch.Tensor:
        """Positions in the flattened [B, V] logits."""
        if self._keys is None:
            self._keys = self.rows * vocab_size + self.token_ids
        return self._keys


@dataclass
class LogitEdits:
    """Values added to the logits at (row, token) pairs: logit biases, and -inf on the step's
    banned tokens (min_tokens stops, completed bad-word prefixes), 0 where a ban does not hold."""

    index: TokenIndex
    values: torch.Tensor  # float32 [K]


@dataclass
class RandomKeys:
    """Where each row's random numbers come from. A seeded request's derive from its seed and
    the number of tokens it has sampled, so they depend on nothing else in the batch; the other
    rows draw fresh ones every step."""

    seeds: tuple[int | None, ...]  # per row: the seed of a seeded request that samples
    num_sampled: tuple[int, ...]  # per row: tokens its request had sampled when the batch formed
    step: int  # steps the batch has sampled since
    tensors: RowKeys | None = None  # the same on the device, and a fresh seed (fused sampler)

    def generators(self, device: torch.device) -> dict[int, torch.Generator]:
        """Batch row -> a generator for this step, for the seeded rows (torch sampler)."""
        return {
            row: torch.Generator(device).manual_seed(
                step_seed(seed, self.num_sampled[row] + self.step)
            )
            for row, seed in enumerate(self.seeds)
            if seed is not None
        }


def step_seed(seed: int, num_sampled: int) -> int:
    """A 64-bit seed for the draw after num_sampled tokens (golden-ratio mixing)."""
    return (seed * 0x9E3779B97F4A7C15 + num_sampled) % 2**64


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # float32 [B]; 1.0 on greedy rows (unused there)
    greedy: torch.Tensor  # bool [B]
    all_greedy: bool
    random: RandomKeys
    top_k: torch.Tensor | None = None  # int64 [B]; 0 where off
    max_top_k: int = 0
    top_k_everywhere: bool = False  # every row has a top_k: top-p never needs a row's full mass
    top_p: torch.Tensor | None = None  # float32 [B]; 1.0 where off
    min_p: torch.Tensor | None = None  # float32 [B]; 0.0 where off
    penalties: Penalties | None = None
    edits: LogitEdits | None = None
    allowed: TokenIndex | None = None  # allowed_token_ids of the rows that restrict
    allowed_rows: torch.Tensor | None = None  # int64: rows that restrict to allowed tokens
    num_logprobs: tuple[int | None, ...] = ()  # per row; None where not asked
    max_num_logprobs: int | None = None
    # int8 [B]: each row's kernels.sampling mode; set when the fused sampler runs the batch
    modes: torch.Tensor | None = None
    any_masked: bool = False  # some row has top-k, top-p or min-p (fused sampler)

    @property
    def fused(self) -> bool:
        return self.modes is not None

    @property
    def no_processors(self) -> bool:
        """True when the logits go to sampling unchanged (apart from temperature)."""
        return (
            self.top_k is None
            and self.top_p is None
            and self.min_p is None
            and self.penalties is None
            and self.edits is None
            and self.allowed is None
        )
