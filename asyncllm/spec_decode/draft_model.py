"""Draft model proposer: a smaller model of the target's vocabulary drafts greedily.

Its KV cache lives in the target's block pool (spec_decode.draft_step). Every step the draft
model runs on the step's inputs (writing its KV where the target writes its own), then drafts
for each sampling request, one token a pass from the token the step sampled, inside the blocks
the request already holds (past them it drafts less).
"""

from __future__ import annotations

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import ModelConfig
from asyncllm.models.causal_lm import CausalLM
from asyncllm.models.loader import load_model
from asyncllm.spec_decode.draft_step import DraftKVCache, TargetStep, one_token_metadata


class DraftModelProposer:
    reads_hidden = False
    drafts_on_device = False
    aux_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, backend: AttentionBackend, num_tokens: int) -> None:
        self.config = config
        self.model: CausalLM = load_model(config, backend)
        self.num_tokens = num_tokens
        self.kv_cache = DraftKVCache(self.model.kv_cache_specs, config.dtype, config.device)

    def bytes_per_block(self, block_size: int) -> int:
        return self.kv_cache.bytes_per_block(block_size)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache.allocate(num_blocks, block_size)

    def draft(self, step: TargetStep) -> list[list[int]]:
        """The step's inputs through the draft model (its KV where the target wrote its own),
        then each sampling row's drafts after its next token."""
        forward = step.forward
        self.model(forward.input_ids, forward.positions, self.kv_cache.tensors, forward.meta)
        if not step.num_sampling:
            return []
        token_ids, drafts = step.next_token_ids, []
        device = token_ids.device
        for j in range(int(step.limits.max(initial=0))):
            at = step.next_positions + j
            meta = one_token_metadata(
                at, j < step.limits, step.block_tables, self.kv_cache.block_size, device
            )
            hidden = self.model(
                token_ids, torch.from_numpy(at).to(device), self.kv_cache.tensors, meta
            )
            token_ids = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(token_ids)
        return stack_drafts(drafts, step)


def stack_drafts(drafts: list[torch.Tensor], step: TargetStep) -> list[list[int]]:
    """Per sampling row, its first limits[r] of the drafts ([R] tensors, one a pass)."""
    if not drafts:
        return [[] for _ in range(step.num_sampling)]
    proposed = torch.stack(drafts, dim=1).tolist()
    return [row[:limit] for row, limit in zip(proposed, step.limits.tolist())]
