"""Rejection sampling of draft tokens: the tokens a request keeps from its drafts are
distributed exactly as the target's own samples (Leviathan et al. 2023; Chen et al. 2023).

Draft x at a position is accepted with probability min(1, p(x) / q(x)), p the target's and q
the draft's distribution there, both after the request's sampling settings. At the first
rejection the recovered token is drawn from max(p - q, 0), normalised, and the request's
tokens end there; when every draft is accepted the bonus token, sampled from the target after
the last draft, follows. Drafts that are single tokens (n-gram, greedy drafting) have q = 1 at
x (draft_probs None). The torch ops here are the CPU path and the reference of the Triton
kernel (kernels/rejection.py), which CUDA tensors take.
"""

from __future__ import annotations

import torch

import kernels


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> torch.Tensor:
    """target_probs, draft_probs float32 [N, V] at the N draft positions (each request's
    num_drafts[r] of them in turn), draft_token_ids int64 [N], num_drafts int64 [R],
    bonus_token_ids int64 [R], uniforms float32 [N] in [0, 1) and exponentials float32 [N, V]
    (Exp(1) draws) -> int64 [R, K + 1] of each request's tokens, -1 after its last; K is the
    largest num_drafts."""
    max_num_drafts = int(num_drafts.max()) if len(num_drafts) else 0
    args = (target_probs, draft_probs, draft_token_ids, num_drafts, bonus_token_ids)
    if target_probs.is_cuda:
        return kernels.rejection_sample(*args, uniforms, exponentials, max_num_drafts)
    return _rejection_sample_torch(*args, uniforms, exponentials, max_num_drafts)


def _rejection_sample_torch(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    max_num_drafts: int,
) -> torch.Tensor:
    device = target_probs.device
    x = draft_token_ids[:, None]
    p_x = target_probs.gather(1, x).squeeze(1)
    if draft_probs is None:
        accepted = uniforms < p_x
        residual = target_probs.scatter(1, x, 0.0)
    else:
        accepted = uniforms * draft_probs.gather(1, x).squeeze(1) < p_x
        residual = (target_probs - draft_probs).clamp_min_(0.0)
    recovered = (residual / exponentials).argmax(dim=1)

    num_reqs, width = len(num_drafts), max_num_drafts + 1
    owner = torch.repeat_interleave(torch.arange(num_reqs, device=device), num_drafts)
    starts = torch.cumsum(num_drafts, 0) - num_drafts
    column = torch.arange(len(owner), device=device) - starts[owner]

    def by_request(values: torch.Tensor, fill: int | bool) -> torch.Tensor:
        table = torch.full((num_reqs, width), fill, dtype=values.dtype, device=device)
        table[owner, column] = values
        return table

    num_accepted = by_request(accepted, False).long().cumprod(dim=1).sum(dim=1, keepdim=True)
    columns = torch.arange(width, device=device)
    out = torch.where(columns < num_accepted, by_request(draft_token_ids, -1), -1)
    last = torch.where(
        num_accepted.squeeze(1) < num_drafts,
        by_request(recovered, -1).gather(1, num_accepted).squeeze(1),
        bonus_token_ids,
    )
    return out.scatter_(1, num_accepted.long(), last[:, None])
