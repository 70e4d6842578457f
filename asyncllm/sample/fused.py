"""The sampler's fused path (CUDA): kernels.sampling's few passes over [B, V] in place of
dozens of torch ops, with the same semantics as the torch path in sampler.py.

The logit edits and penalties change the logits in place at a few tokens per row; prepare_logits
reads each row once, giving greedy rows their argmax and sampling the rows without masks;
sample_masked samples the rows with top-k / top-p / min-p; logprobs take one more pass, over
the raw logits (put back where edited) or over the processed ones.
"""

from __future__ import annotations

import torch

import kernels
from asyncllm.sample.edits import apply_token_edits
from asyncllm.sample.logprobs import LogprobsTensors
from asyncllm.sample.metadata import SamplingMetadata


def sample_fused(
    logits: torch.Tensor, meta: SamplingMetadata, logprobs_mode: str
) -> tuple[torch.Tensor, LogprobsTensors | None]:
    """logits [B, V] float32 contiguous, modified in place -> sampled ids and logprobs."""
    n = meta.max_num_logprobs
    raw_logprobs = n is not None and logprobs_mode == "raw_logprobs"
    processed_logprobs = n is not None and not raw_logprobs
    raw = logits.clone() if raw_logprobs and meta.allowed is not None else logits
    edited = _edit(logits, meta, keep=raw_logprobs and raw is logits)
    keys = meta.random.tensors
    stats = kernels.prepare_logits(logits, meta.temperature, meta.modes, keys)
    cutoff = None
    if meta.any_masked and (not meta.all_greedy or processed_logprobs):
        cutoff = kernels.sample_masked(
            logits,
            meta.temperature,
            stats,
            meta.modes,
            keys,
            meta.top_k,
            meta.top_p,
            meta.min_p,
            greedy_cutoffs=processed_logprobs,
        )
    if raw_logprobs:
        _unedit(logits, meta, *edited)
        found = kernels.row_logprobs(raw, stats.sampled, n)
        return stats.sampled, LogprobsTensors(*found)
    if processed_logprobs:
        if cutoff is None:
            cutoff = torch.full_like(meta.temperature, float("-inf"))
        found = kernels.row_logprobs(logits, stats.sampled, n, meta.temperature, cutoff)
        return stats.sampled, LogprobsTensors(*found)
    return stats.sampled, None


def _edit(
    logits: torch.Tensor, meta: SamplingMetadata, keep: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Logit edits and penalties in place; keep: return the values they replace."""
    saved_edits = saved_penalties = None
    if keep and meta.edits is not None:
        saved_edits = logits.view(-1).index_select(0, meta.edits.index.keys(logits.shape[-1]))
    apply_token_edits(logits, meta)
    if meta.penalties is not None:
        if keep:
            saved_penalties = logits.new_empty(logits.shape[0], meta.penalties.tokens.shape[1])
        kernels.penalize(logits, meta.penalties, saved_penalties)
    return saved_edits, saved_penalties


def _unedit(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    saved_edits: torch.Tensor | None,
    saved_penalties: torch.Tensor | None,
) -> None:
    """Puts back the values _edit replaced, the penalties' first."""
    if saved_penalties is not None:
        kernels.restore(logits, meta.penalties, saved_penalties)
    if saved_edits is not None:
        keys = meta.edits.index.keys(logits.shape[-1])
        logits.view(-1).index_copy_(0, keys, saved_edits)
