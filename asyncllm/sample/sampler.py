"""Batched sampling on the device: greedy and temperature, per-request seeds.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws from p. A seeded request
draws its E from its own generator, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # float32 [B]; 1.0 where greedy (unused there)
    greedy: torch.Tensor  # bool [B]
    all_greedy: bool
    generators: dict[int, torch.Generator]  # batch row -> generator of a seeded request

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],
        device: torch.device,
    ) -> SamplingMetadata:
        greedy = [p.greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            generators=generators,
        )


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits [B, V] float32 -> sampled token ids [B] int64."""
        greedy_ids = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_ids
        probs = torch.softmax(logits / meta.temperature[:, None], dim=-1)
        noise = self._exponential_noise(probs, meta.generators)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(meta.greedy, greedy_ids, sampled)

    @staticmethod
    def _exponential_noise(
        probs: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_()
        for row, generator in generators.items():
            noise[row].exponential_(generator=generator)
        return noise
