"""Rejection sampling of drafts: the kept tokens are distributed as the target's own samples
(chi-square at a fixed seed), the Triton kernel gives the torch path's tokens, and the verify
step samples every draft position with the request's settings."""

import pytest
import torch

from asyncllm.request import Request
from asyncllm.sample.rejection import _rejection_sample_torch, rejection_sample
from asyncllm.sample.sampler import Sampler
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams
from asyncllm.spec_decode.verify import DraftLayout, verify_drafts
from kernels import rejection as rejection_kernel

VOCAB = 8
SAMPLES = 40_000  # a 2% shift of one token's probability moves chi-square by ~40 here
CHI2_CRITICAL_7_DF = 24.32  # p = 0.001
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token of probability 0 was sampled"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(VOCAB, generator=g) * 1.5, 0)
    q = torch.softmax(torch.randn(VOCAB, generator=g) * 1.5, 0)
    return p, q


def sample_two_drafts(p, q, draft_probs: bool, seed: int = 0) -> torch.Tensor:
    """SAMPLES requests with two drafts each; p at both positions; drafts drawn from q (or the
    fixed token 3 when drafts are single tokens)."""
    g = torch.Generator().manual_seed(seed)
    n = 2 * SAMPLES
    if draft_probs:
        drafts = torch.multinomial(q, n, replacement=True, generator=g)
    else:
        drafts = torch.full((n,), 3)
    bonus = torch.multinomial(p, SAMPLES, replacement=True, generator=g)
    uniforms = torch.rand(n, generator=g)
    exponentials = torch.empty(n, VOCAB).exponential_(generator=g)
    return _rejection_sample_torch(
        p.expand(n, VOCAB),
        q.expand(n, VOCAB) if draft_probs else None,
        drafts,
        torch.full((SAMPLES,), 2),
        bonus,
        uniforms,
        exponentials,
        2,
    )


@pytest.mark.parametrize("draft_probs", [True, False])
def test_kept_tokens_are_distributed_as_the_target(draft_probs):
    p, q = distributions(1)
    out = sample_two_drafts(p, q, draft_probs)
    assert chi_square(out[:, 0], p) < CHI2_CRITICAL_7_DF
    # the second position follows an accepted first one; with p the same there it is p again
    assert chi_square(out[out[:, 1] >= 0, 1], p) < CHI2_CRITICAL_7_DF


def test_the_test_sees_a_two_percent_shift():
    p, q = distributions(1)
    out = sample_two_drafts(p, q, draft_probs=True)
    shifted = p.clone()
    shifted[0] += 0.02
    shifted[1] -= 0.02
    assert chi_square(out[:, 0], shifted) > CHI2_CRITICAL_7_DF


def test_equal_draft_and_target_accept_every_draft():
    p, _ = distributions(2)
    out = sample_two_drafts(p, p, draft_probs=True)
    assert (out[:, :2] >= 0).all()


@pytest.mark.parametrize("vocab", [5, 1000, 4099])
@pytest.mark.parametrize("draft_probs", [True, False])
def test_the_kernel_gives_the_torch_paths_tokens(vocab, draft_probs):
    g = torch.Generator().manual_seed(vocab)
    num_drafts = torch.tensor([0, 3, 1, 4, 2])
    n = int(num_drafts.sum())
    target = torch.softmax(torch.randn(n, vocab, generator=g) * 3, 1)
    draft = torch.softmax(torch.randn(n, vocab, generator=g) * 3, 1) if draft_probs else None
    drafts = torch.randint(vocab, (n,), generator=g)
    # drafts that are the target's favourites, so that some are accepted
    drafts[::2] = target[::2].argmax(1)
    bonus = torch.randint(vocab, (len(num_drafts),), generator=g)
    uniforms = torch.rand(n, generator=g)
    exponentials = torch.empty(n, vocab).exponential_(generator=g)
    args = [target, draft, drafts, num_drafts, bonus, uniforms, exponentials]
    args = [a.to(DEVICE) if a is not None else None for a in args]
    want = _rejection_sample_torch(*args, 4)
    got = rejection_kernel.rejection_sample(*args, 4)
    assert torch.equal(got.cpu(), want.cpu())
    assert (want[:, 0] >= 0).all() and (want[0, 1:] == -1).all()


def test_the_dispatcher_takes_the_torch_path_on_cpu():
    p, q = distributions(3)
    n = 2
    args = [p.expand(n, VOCAB), q.expand(n, VOCAB), torch.tensor([1, 2]), torch.tensor([2])]
    out = rejection_sample(*args, torch.tensor([4]), torch.rand(n), torch.ones(n, VOCAB))
    assert out.shape == (1, 3)


def processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The definition: temperature, the top_k largest, the fewest largest of mass >= top_p."""
    probs = torch.softmax(logits / temperature, 0)
    order = probs.argsort(descending=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[order[: top_k if top_k > 0 else VOCAB]] = True
    probs = torch.where(keep, probs, 0)
    probs /= probs.sum()
    sorted_probs = probs[order]
    before = sorted_probs.cumsum(0) - sorted_probs
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[order[before < top_p]] = True
    probs = torch.where(keep, probs, 0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 4, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.9)]
)
def test_verify_samples_every_draft_position_with_the_requests_settings(temperature, top_k, top_p):
    """SAMPLES requests, each verifying one draft: its first token is the target's sample; the
    second (after an accepted draft) is too."""
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    requests = [Request(str(i), [0], params) for i in range(SAMPLES)]
    meta = SamplingState(torch.device("cpu"), VOCAB, fused=False).metadata(requests)
    draft = int(logits.argmax())
    drafts = [[draft] for _ in requests]
    rows = logits.expand(2 * SAMPLES, VOCAB)
    scored_ids = torch.tensor([0, draft] * SAMPLES)  # each row: its last token (0), its draft
    verification = verify_drafts(Sampler(), rows, meta, DraftLayout.of(drafts), scored_ids)
    tokens, _, verified = verification.results(list(range(SAMPLES)), SAMPLES)
    want = processed(logits, temperature, top_k, top_p)
    assert chi_square(torch.tensor(tokens), want) < CHI2_CRITICAL_7_DF
    seconds = torch.tensor([t[1] for t in verified.token_ids if len(t) == 2])
    assert len(seconds) > SAMPLES * float(want[draft]) * 0.9
    assert chi_square(seconds, want) < CHI2_CRITICAL_7_DF
