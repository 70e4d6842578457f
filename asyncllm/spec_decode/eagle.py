"""EAGLE and EAGLE-3 proposers: a draft head reads the target's hidden states and drafts
greedily, k tokens a request chained one pass at a time.

Every step the head first runs over the step's rows, row t reading token t+1 and the target's
state at t (its KV goes where the target wrote row t's); the row of each sampling request whose
sample is its next token gives the first draft. Each further pass reads the last draft and the
head's own state of the pass before, one position on. Greedy drafts are single tokens, which
the verify step accepts exactly (spec_decode.verify): no draft probabilities are needed.
"""

from __future__ import annotations

import torch

from asyncllm.config import ModelConfig
from asyncllm.models.eagle import Eagle3LlamaHead, EagleLlamaHead
from asyncllm.spec_decode.draft_model import stack_drafts
from asyncllm.spec_decode.draft_step import DraftKVCache, TargetStep, one_token_metadata


class EagleProposer:
    reads_hidden = True
    drafts_on_device = False

    def __init__(
        self, head: EagleLlamaHead | Eagle3LlamaHead, num_tokens: int, config: ModelConfig
    ) -> None:
        self.head = head
        self.aux_layers: tuple[int, ...] = head.aux_layers
        self.num_tokens = num_tokens
        self.kv_cache = DraftKVCache(head.kv_cache_specs, config.dtype, config.device)

    def draft(self, step: TargetStep) -> list[list[int]]:
        forward, caches = step.forward, self.kv_cache.tensors
        states = torch.cat(forward.aux_hidden, dim=-1) if self.aux_layers else forward.hidden
        hidden = self.head.combine_hidden_states(states)
        out, hidden = self.head(
            step.following_ids(), forward.positions, hidden, caches, forward.meta
        )
        if not step.num_sampling:
            return []
        token_ids = self.head.draft_token_ids(out[step.sampled_rows])
        hidden, drafts = hidden[step.sampled_rows], [token_ids]
        device = token_ids.device
        for j in range(int(step.limits.max()) - 1):
            at = step.next_positions + j
            writes = j + 1 < step.limits
            meta = one_token_metadata(
                at, writes, step.block_tables, self.kv_cache.block_size, device
            )
            positions = torch.from_numpy(at).to(device)
            out, hidden = self.head(token_ids, positions, hidden, caches, meta)
            token_ids = self.head.draft_token_ids(out)
            drafts.append(token_ids)
        return stack_drafts(drafts, step)
