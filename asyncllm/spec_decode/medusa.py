"""Medusa proposer: k heads on the target's final hidden state at the row whose sample is a
request's next token guess the k tokens after it, greedily, in one pass (no KV cache). It reads
nothing from the host, so it drafts on the device and a request's next step may run ahead."""

from __future__ import annotations

import torch

from asyncllm.config import ModelConfig
from asyncllm.models.medusa import MedusaHeads
from asyncllm.spec_decode.draft_step import DraftBatch, DraftKVCache


class MedusaProposer:
    reads_hidden = True
    drafts_on_device = True
    aux_layers: tuple[int, ...] = ()

    def __init__(self, heads: MedusaHeads, num_tokens: int, config: ModelConfig) -> None:
        if heads.config.num_heads < num_tokens:
            raise ValueError(
                f"speculative_config num_speculative_tokens {num_tokens} exceeds the "
                f"{heads.config.num_heads} Medusa heads"
            )
        self.heads = heads
        self.num_tokens = num_tokens
        self.kv_cache = DraftKVCache([], config.dtype, config.device)

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        return self.heads.draft_token_ids(batch.hidden[batch.sampled_rows], self.num_tokens)
