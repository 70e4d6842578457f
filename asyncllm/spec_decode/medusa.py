"""Medusa proposer: k heads on the target's final hidden state at the row whose sample is a
request's next token guess the k tokens after it, greedily, in one pass (no KV cache)."""

from __future__ import annotations

from asyncllm.config import ModelConfig
from asyncllm.models.medusa import MedusaHeads
from asyncllm.spec_decode.draft_model import stack_drafts
from asyncllm.spec_decode.draft_step import DraftKVCache, TargetStep


class MedusaProposer:
    reads_hidden = True
    drafts_on_device = False
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

    def draft(self, step: TargetStep) -> list[list[int]]:
        if not step.num_sampling:
            return []
        hidden = step.forward.hidden[step.sampled_rows]
        guesses = self.heads.draft_token_ids(hidden, self.num_tokens)
        return stack_drafts(list(guesses.unbind(dim=1)), step)
