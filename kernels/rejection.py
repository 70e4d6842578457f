"""Rejection sampling of draft tokens (Leviathan et al. 2023; Chen et al. 2023), one program a
request: walk its drafts, accept draft x with probability min(1, p(x) / q(x)), and at the first
rejection take the recovered token, the exponential race argmax(max(p - q, 0) / E) over the
vocabulary (with single-token drafts q is 1 at x: p without x); past the last accepted draft
comes the bonus token. The torch reference is asyncllm/sample/rejection.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_V = 1024


@triton.jit
def _rejection_kernel(
    out_ptr,  # int64 [R, K + 1], filled with -1
    out_stride,
    target_ptr,  # float32 [N, V]
    draft_probs_ptr,  # float32 [N, V]; unread when HAS_DRAFT_PROBS is false
    draft_ids_ptr,  # int64 [N]
    starts_ptr,  # int64 [R]
    num_drafts_ptr,  # int64 [R]
    bonus_ptr,  # int64 [R]
    uniform_ptr,  # float32 [N]
    exp_ptr,  # float32 [N, V]
    vocab,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    start = tl.load(starts_ptr + r)
    k = tl.load(num_drafts_ptr + r)
    rejected = False
    for j in range(0, k):
        if not rejected:
            i = start + j
            x = tl.load(draft_ids_ptr + i)
            p = tl.load(target_ptr + i * vocab + x)
            q = 1.0
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + i * vocab + x)
            u = tl.load(uniform_ptr + i)
            if u * q < p:
                tl.store(out_ptr + r * out_stride + j, x)
            else:
                best = -1.0
                best_id = 0
                for v0 in range(0, vocab, BLOCK_V):
                    v = v0 + tl.arange(0, BLOCK_V)
                    inside = v < vocab
                    pv = tl.load(target_ptr + i * vocab + v, mask=inside, other=0.0)
                    if HAS_DRAFT_PROBS:
                        qv = tl.load(draft_probs_ptr + i * vocab + v, mask=inside, other=0.0)
                        residual = tl.maximum(pv - qv, 0.0)
                    else:
                        residual = tl.where(v == x, 0.0, pv)
                    e = tl.load(exp_ptr + i * vocab + v, mask=inside, other=1.0)
                    score = tl.where(inside, tl.div_rn(residual, e), -1.0)
                    block_best = tl.max(score, axis=0)
                    block_id = tl.argmax(score, axis=0) + v0
                    if block_best > best:
                        best = block_best
                        best_id = block_id
                tl.store(out_ptr + r * out_stride + j, best_id.to(tl.int64))
                rejected = True
    if not rejected:
        tl.store(out_ptr + r * out_stride + k, tl.load(bonus_ptr + r))


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    max_num_drafts: int,
) -> torch.Tensor:
    """The arguments of asyncllm.sample.rejection.rejection_sample -> int64 [R, K + 1]."""
    num_reqs = len(num_drafts)
    out = torch.full(
        (num_reqs, max_num_drafts + 1), -1, dtype=torch.int64, device=target_probs.device
    )
    if num_reqs == 0:
        return out
    starts = torch.cumsum(num_drafts, 0) - num_drafts
    vocab = target_probs.shape[1]
    _rejection_kernel[(num_reqs,)](
        out,
        out.stride(0),
        target_probs,
        draft_probs if draft_probs is not None else target_probs,
        draft_token_ids,
        starts,
        num_drafts,
        bonus_token_ids,
        uniforms,
        exponentials,
        vocab,
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)),
    )
    return out
