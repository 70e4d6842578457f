"""What a proposer next to the target model reads of the step the target just ran, and the
attention metadata of its own passes that draft one token a request.

A proposer with layers (a draft model, an EAGLE head) keeps a KV cache of its own with a tensor
per layer of the target's block count, addressed by the same block tables and slots: the block
pool holds both models' KV of a block. Positions it drafts past are overwritten by the next
step's inputs, as the target's rejected ones are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.kv_cache_spec import KVCacheSpec
from asyncllm.core.scheduler_output import ScheduledRequest


@dataclass
class TargetForward:
    """What the target's forward pass took and kept."""

    input_ids: torch.Tensor  # int64 [T]: the step's tokens, padding included
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata  # the step's: a proposer's KV goes where the target's went
    hidden: torch.Tensor | None  # [T, H]: the final hidden states, where the target kept them
    aux_hidden: list[torch.Tensor]  # [T, H] each: the states entering the layers asked for


@dataclass
class TargetStep:
    """A step of the target. Sampling rows are the requests that sampled a next token."""

    forward: TargetForward
    follow_rows: torch.Tensor  # int64 [N]: each scheduled request's last row that counts
    follow_ids: torch.Tensor  # int64 [N]: the token after it
    # per sampling row
    sampled_rows: torch.Tensor  # int64 [R]: the row whose sample is the next token
    next_token_ids: torch.Tensor  # int64 [R]
    next_positions: np.ndarray  # int64 [R]: the next token's position
    block_tables: np.ndarray  # int32 [R, W]
    limits: np.ndarray  # int64 [R]: the most drafts a row takes (its blocks' room)

    @property
    def num_sampling(self) -> int:
        return len(self.next_positions)

    def following_ids(self) -> torch.Tensor:
        """Each row's next token: EAGLE heads read (token t+1, hidden state t)."""
        shifted = self.forward.input_ids.roll(-1)
        shifted[self.follow_rows] = self.follow_ids
        return shifted


@dataclass
class DraftBatch:
    """What a proposer on the device sees of a step: where its input tokens went, the tokens
    of requests new to their rows, each sampling row's next token, and the hidden states."""

    input_ids: torch.Tensor  # [T] the step's input tokens (no padding)
    positions: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T] each token's input-batch row
    known: list[tuple[int, list[int]]]  # (row, the tokens before the step) of rows new to it
    rows: torch.Tensor  # [R] each sampling row's input-batch row
    next_token_ids: torch.Tensor  # [R]
    next_positions: torch.Tensor  # [R]
    max_len: int  # at least every sampling row's token count after the step
    hidden: torch.Tensor | None  # [T', H] the step's final hidden states, where kept
    sampled_rows: torch.Tensor  # [R] the row of hidden whose sample is each next token


@dataclass(frozen=True)
class DraftLimits:
    block_size: int
    max_model_len: int
    max_drafts: int  # num_speculative_tokens


def target_step(
    forward: TargetForward,
    scheduled: list[ScheduledRequest],
    sampling_rows: list[int],
    next_token_ids: torch.Tensor | None,
    num_accepted: list[int],
    block_tables: np.ndarray,
    limits: DraftLimits,
) -> TargetStep:
    """num_accepted: the drafts each sampling row kept (0 without drafts); block_tables:
    their rows of the block table."""
    device = forward.input_ids.device
    ends = np.cumsum([s.num_new_tokens for s in scheduled], dtype=np.int64)
    sampling = [scheduled[r] for r in sampling_rows]
    accepted = np.array(num_accepted, dtype=np.int64)
    num_drafts = np.array([len(s.spec_token_ids) for s in sampling], dtype=np.int64)
    sampled_rows = ends[sampling_rows] - 1 - num_drafts + accepted
    computed = [s.num_computed_tokens + s.num_new_tokens for s in sampling]
    next_positions = np.array(computed, dtype=np.int64) - num_drafts + accepted
    capacity = np.array([len(s.block_ids) for s in sampling], dtype=np.int64) * limits.block_size
    room = np.minimum(capacity, limits.max_model_len) - next_positions
    # a request part way through its prompt is followed by its next prompt token
    chunks = sorted(set(range(len(scheduled))) - set(sampling_rows))
    chunk_ids = [_token_at(scheduled[r], int(ends[r])) for r in chunks]
    if next_token_ids is None:
        next_token_ids = torch.zeros(0, dtype=torch.int64, device=device)
    follow_rows = np.concatenate([sampled_rows, ends[chunks] - 1])
    return TargetStep(
        forward=forward,
        follow_rows=torch.from_numpy(follow_rows).to(device),
        follow_ids=torch.cat(
            [next_token_ids, torch.tensor(chunk_ids, dtype=torch.int64).to(device)]
        ),
        sampled_rows=torch.from_numpy(sampled_rows).to(device),
        next_token_ids=next_token_ids,
        next_positions=next_positions,
        block_tables=block_tables,
        limits=np.clip(room, 0, limits.max_drafts),
    )


def _token_at(scheduled: ScheduledRequest, position: int) -> int:
    tokens = scheduled.request.all_token_ids
    return tokens[position] if position < len(tokens) else 0


class DraftKVCache:
    """A proposer's own KV cache tensors, one per layer, in the target's block pool."""

    def __init__(self, specs: list[KVCacheSpec], dtype: torch.dtype, device: torch.device):
        self.specs, self.dtype, self.device = specs, dtype, device
        self.tensors: list[torch.Tensor] = []

    def bytes_per_block(self, block_size: int) -> int:
        return sum(spec.block_bytes(block_size, self.dtype) for spec in self.specs)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.tensors = [
            torch.zeros(spec.shape(num_blocks, block_size), dtype=self.dtype, device=self.device)
            for spec in self.specs
        ]

    @property
    def block_size(self) -> int:
        return self.tensors[0].shape[2]


def one_token_metadata(
    at: np.ndarray, writes: np.ndarray, block_tables: np.ndarray, block_size: int, device
) -> AttentionMetadata:
    """A pass of one token a request at positions `at`; rows where `writes` is off attend to
    one position and write nowhere (they have no room left)."""
    num_reqs = len(at)
    blocks = block_tables[
        np.arange(num_reqs), np.minimum(at // block_size, block_tables.shape[1] - 1)
    ]
    slots = np.where(writes, blocks.astype(np.int64) * block_size + at % block_size, -1)
    seq_lens = np.where(writes, at + 1, 1)
    return AttentionMetadata(
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device=device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        query_lens_cpu=[1] * num_reqs,
        seq_lens_cpu=seq_lens.tolist(),
    )
