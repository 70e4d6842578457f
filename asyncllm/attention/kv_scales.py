"""The per-tensor scales of one layer's FP8 KV cache, as FP8 checkpoints carry them.

An FP8 cache stores e4m3(k / k_scale) and e4m3(v / v_scale), saturated at e4m3's +-448, and
attention reads k_scale * stored and v_scale * stored. Both backends apply the scales without
widening the cache: k_scale multiplies the softmax scale (q . (s k) = s (q . k)) and v_scale the
output (softmax weights sum to one). A cache of the model's own dtype ignores them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVScales:
    k: float = 1.0  # 1.0: the checkpoint has none; keys are stored as they are
    v: float = 1.0

    def for_cache(self, kv_cache: torch.Tensor) -> KVScales:
        """These scales for an FP8 (1-byte) cache, unit scales for any other."""
        return self if kv_cache.element_size() == 1 else UNIT_KV_SCALES


UNIT_KV_SCALES = KVScales()
