"""Draft model proposer: a smaller model of the target's vocabulary drafts greedily.

Its KV cache has a tensor per layer of the target's block count, addressed by the same block
tables and slots: the block pool holds both models' KV of a block, and a request's blocks
serve both. Every step the draft model runs on the step's inputs (writing its KV where the
target writes its own), then drafts for each sampling request, one token a pass from the token
the step sampled, inside the blocks the request already holds (past them it drafts less).
Rejected positions are overwritten by the next step's inputs, as the target's are.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.config import ModelConfig
from asyncllm.models.causal_lm import CausalLM
from asyncllm.models.loader import load_model


class DraftModelProposer:
    def __init__(self, config: ModelConfig, backend: AttentionBackend, num_tokens: int) -> None:
        self.config = config
        self.model: CausalLM = load_model(config, backend)
        self.num_tokens = num_tokens
        self.kv_caches: list[torch.Tensor] = []

    def bytes_per_block(self, block_size: int) -> int:
        specs = self.model.kv_cache_specs
        return sum(spec.block_bytes(block_size, self.config.dtype) for spec in specs)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> None:
        device, dtype = self.config.device, self.config.dtype
        self.kv_caches = [
            torch.zeros(spec.shape(num_blocks, block_size), dtype=dtype, device=device)
            for spec in self.model.kv_cache_specs
        ]

    def catch_up(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """The step's inputs through the draft model: its KV where the target writes its own."""
        self.model(input_ids, positions, self.kv_caches, meta)

    def propose(
        self,
        token_ids: torch.Tensor,
        positions: np.ndarray,
        block_tables: np.ndarray,
        limits: np.ndarray,
    ) -> list[list[int]]:
        """token_ids int64 [R] on the device: each request's token at positions[r] (host), its
        block table rows block_tables [R, W]; row r drafts up to limits[r] tokens."""
        device = token_ids.device
        block_size = self.kv_caches[0].shape[2]
        num_reqs = len(positions)
        drafts = []
        query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32, device=device)
        tables = torch.from_numpy(block_tables.astype(np.int32)).to(device)
        for j in range(int(limits.max(initial=0))):
            at = positions + j
            writes = j < limits
            blocks = block_tables[
                np.arange(num_reqs), np.minimum(at // block_size, block_tables.shape[1] - 1)
            ]
            slots = np.where(writes, blocks.astype(np.int64) * block_size + at % block_size, -1)
            seq_lens = np.where(writes, at + 1, 1)
            meta = AttentionMetadata(
                query_start_loc=query_start_loc,
                seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
                block_tables=tables,
                slot_mapping=torch.from_numpy(slots).to(device),
                max_query_len=1,
                max_seq_len=int(seq_lens.max()),
                query_lens_cpu=[1] * num_reqs,
                seq_lens_cpu=seq_lens.tolist(),
            )
            hidden = self.model(token_ids, torch.from_numpy(at).to(device), self.kv_caches, meta)
            token_ids = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(token_ids)
        if not drafts:
            return [[] for _ in range(num_reqs)]
        proposed = torch.stack(drafts, dim=1).tolist()
        return [row[:limit] for row, limit in zip(proposed, limits.tolist())]
