"""kernels/sampling.py and the fused sampler (on CPU tensors under the Triton interpreter, on the
GPU when there is one),
against the torch sampler and against plain definitions."""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from asyncllm.request import Request
from asyncllm.sample.sampler import Sampler, apply_min_p, apply_top_k_top_p
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams
from kernels import sampling, sampling_rows

# the interpreter evaluates both sides of tl.where, log(0) included
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")

SIZES = [(1, 5), (3, 1000), (7, 4099)]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# small blocks and tiles, so that every size above spans several
BLOCKS = dict(block=256, tile=64)
_request_ids = itertools.count()


@pytest.fixture(autouse=True)
def on_the_device():
    """Tensors made without a device go to the GPU when there is one: the kernels need it."""
    with DEVICE:
        yield


def make_request(params: SamplingParams, prompt=(0, 1), output=()) -> Request:
    request = Request(str(next(_request_ids)), list(prompt), params, eos_token_ids=frozenset({2}))
    for token_id in output:
        request.append_output_token(token_id)
    return request


def row_keys(
    rows: int, seeds=None, num_sampled=None, step=0, fresh_seed=99
) -> sampling_rows.RowKeys:
    seeds = seeds or [None] * rows
    num_sampled = num_sampled or [0] * rows
    return sampling_rows.RowKeys(
        torch.tensor([s or 0 for s in seeds]),
        torch.tensor([s is not None for s in seeds], dtype=torch.int8),
        torch.tensor(num_sampled),
        step,
        fresh_seed,
    )


def modes(kinds: list[int]) -> torch.Tensor:
    return torch.tensor(kinds, dtype=torch.int8)


@triton.jit
def _uniforms_kernel(out_ptr, seed_ptr, counter_ptr, vocab, BLOCK: tl.constexpr):
    """Token t's draw: lane t % 4 of Philox4x32 at (seed, counter << 32 | t // 4)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    offsets = (tl.load(counter_ptr + row) << 32) | (cols // 4).to(tl.int64)
    lanes = tl.rand4x(tl.load(seed_ptr + row), offsets)
    uniforms = tl.where(cols % 4 == 0, lanes[0], lanes[1])
    uniforms = tl.where(cols % 4 == 2, lanes[2], uniforms)
    uniforms = tl.where(cols % 4 == 3, lanes[3], uniforms)
    tl.store(out_ptr + row * vocab + cols, uniforms, mask=cols < vocab)


def race_winners(z: torch.Tensor, kept: torch.Tensor, keys: sampling_rows.RowKeys) -> torch.Tensor:
    """The exponential race over the kept tokens with the kernels' Philox draws, in torch."""
    rows, vocab = z.shape
    seeded = keys.seeded.bool()
    seed = torch.where(seeded, keys.seed, keys.fresh_seed)
    counter = torch.where(seeded, keys.num_sampled + keys.step, torch.arange(rows))
    uniforms = torch.empty(rows, vocab)
    _uniforms_kernel[(rows,)](uniforms, seed, counter, vocab, BLOCK=triton.next_power_of_2(vocab))
    scores = z - (-uniforms.log()).log()
    return scores.masked_fill(~kept, float("-inf")).argmax(dim=-1)


def torch_kept(z: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    masked = apply_min_p(z.clone(), min_p)
    return apply_top_k_top_p(masked, top_k, top_p, int(top_k.max())) > float("-inf")


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    support = expected > 0
    statistic = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    dof = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2), statistic / 2).item()


def penalties_of(requests, vocab: int):
    """The penalties of a batch of requests, as a fresh SamplingState builds them."""
    state = SamplingState(DEVICE, vocab, fused=True)
    return state.metadata(requests).penalties


@pytest.mark.parametrize(("rows", "vocab"), SIZES)
def test_penalize_applies_the_formulas_and_restores(rows, vocab) -> None:
    torch.manual_seed(rows)
    logits = torch.randn(rows, vocab) * 3
    params = [
        SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=0.4),
        SamplingParams(),
        SamplingParams(frequency_penalty=-0.5),
    ]
    requests = [
        make_request(
            params[i % 3], torch.randint(vocab, (4,)).tolist(), torch.randint(vocab, (6,)).tolist()
        )
        for i in range(rows)
    ]
    expected = logits.clone()
    for row, request in enumerate(requests):
        p = request.sampling_params
        counts = torch.bincount(torch.tensor(request.output_token_ids), minlength=vocab)
        seen = counts > 0
        if p.repetition_penalty != 1.0:
            seen[request.prompt_token_ids] = True
        x = expected[row]
        rep = p.repetition_penalty
        x[seen] = torch.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    penalties = penalties_of(requests, vocab)
    got = logits.clone()
    saved = torch.empty(rows, penalties.tokens.shape[1])
    sampling.penalize(got, penalties, saved)
    torch.testing.assert_close(got, expected)
    sampling.restore(got, penalties, saved)
    assert torch.equal(got, logits)


@pytest.mark.parametrize(("rows", "vocab"), SIZES)
def test_prepare_gives_the_statistics_of_logits_over_temperature(rows, vocab) -> None:
    torch.manual_seed(rows)
    logits = torch.randn(rows, vocab) * 3
    temperature = torch.rand(rows) + 0.5
    z = logits / temperature[:, None]
    kinds = modes([sampling_rows.GREEDY] * rows)
    stats = sampling.prepare_logits(logits, temperature, kinds, row_keys(rows), **BLOCKS)
    assert torch.equal(stats.argmax, z.argmax(dim=-1))
    assert torch.equal(stats.sampled, stats.argmax)
    torch.testing.assert_close(stats.peak, z.amax(dim=-1))
    torch.testing.assert_close(stats.lse, z.logsumexp(dim=-1))
    padded = torch.nn.functional.pad(z, (0, -vocab % 64), value=float("-inf"))
    assert torch.equal(stats.tile_max, padded.view(rows, -1, 64).amax(dim=-1))


@pytest.mark.parametrize(("rows", "vocab"), SIZES)
@pytest.mark.parametrize("capacity", [1024, 4], ids=["candidates", "overflow"])
def test_masked_rows_keep_what_torch_keeps_and_race_over_it(rows, vocab, capacity) -> None:
    torch.manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab) * 2
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0, 1.0])[:rows]
    z = logits / temperature[:, None]
    top_k = torch.tensor([3, 0, 40, 7, 0, 1, 2])[:rows]
    top_p = torch.tensor([1.0, 0.6, 0.9, 0.5, 1.0, 1.0, 0.3])[:rows]
    min_p = torch.tensor([0.0, 0.0, 0.02, 0.0, 0.1, 0.0, 0.0])[:rows]
    keys = row_keys(rows, seeds=[None, 5, 6, None, 8, 9, 10][:rows], num_sampled=[4] * rows)
    kinds = modes([sampling_rows.MASKED] * rows)
    stats = sampling.prepare_logits(logits, temperature, kinds, keys, **BLOCKS)
    cutoff = sampling.sample_masked(
        logits, temperature, stats, kinds, keys, top_k, top_p, min_p, capacity=capacity, block=256
    )
    kept = torch_kept(z, top_k, top_p, min_p)
    assert torch.equal(z >= cutoff[:, None], kept)
    assert torch.equal(stats.sampled, race_winners(z, kept, keys))


@pytest.mark.parametrize(("rows", "vocab"), SIZES)
def test_race_rows_sample_in_prepare_with_the_same_draws(rows, vocab) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(rows, vocab)
    temperature = torch.full((rows,), 0.8)
    keys = row_keys(rows, seeds=[3, None, 4, None, 5, None, 6][:rows], step=2)
    kinds = modes([sampling_rows.RACE] * rows)
    stats = sampling.prepare_logits(logits, temperature, kinds, keys, **BLOCKS)
    everything = torch.ones(rows, vocab, dtype=torch.bool)
    assert torch.equal(stats.sampled, race_winners(logits / 0.8, everything, keys))


def test_race_frequencies_match_the_softmax() -> None:
    logits = torch.tensor([2.0, 1.5, 1.1, 0.7, 0.2, -0.3, -1.0, -2.2])
    num_samples = 800
    kinds = modes([sampling_rows.RACE] * num_samples)
    keys = row_keys(num_samples, fresh_seed=1234)
    temperature = torch.full((num_samples,), 0.7)
    stats = sampling.prepare_logits(logits.repeat(num_samples, 1), temperature, kinds, keys)
    counts = torch.bincount(stats.sampled, minlength=8).double()
    expected = torch.softmax(logits.double() / 0.7, dim=-1) * num_samples
    assert chi_square_p_value(counts, expected) > 1e-3


def test_masked_frequencies_match_the_kept_softmax() -> None:
    logits = torch.tensor([2.0, 1.5, 1.1, 0.7, 0.2, -0.3, -1.0, -2.2])
    num_samples = 250
    kinds = modes([sampling_rows.MASKED] * num_samples)
    keys = row_keys(num_samples, fresh_seed=4321)
    rows = logits.repeat(num_samples, 1)
    temperature = torch.ones(num_samples)
    stats = sampling.prepare_logits(rows, temperature, kinds, keys)
    top_k = torch.full((num_samples,), 4)
    sampling.sample_masked(rows, temperature, stats, kinds, keys, top_k, None, None, capacity=8)
    counts = torch.bincount(stats.sampled, minlength=8).double()
    expected = torch.softmax(logits.double()[:4], dim=-1) * num_samples
    assert counts[4:].sum() == 0
    assert chi_square_p_value(counts[:4], expected) > 1e-3


@pytest.mark.parametrize(("rows", "vocab"), SIZES)
@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
def test_row_logprobs_match_log_softmax(rows, vocab, processed) -> None:
    torch.manual_seed(rows * vocab)
    src = torch.randn(rows, vocab) * 2
    temperature = cutoff = None
    reference = src
    if processed:  # over src / temperature, -inf below the third largest
        temperature = torch.rand(rows) + 0.5
        reference = src / temperature[:, None]
        cutoff = reference.topk(min(3, vocab), dim=-1).values[:, -1]
        reference = reference.masked_fill(reference < cutoff[:, None], float("-inf"))
    reference = torch.log_softmax(reference, dim=-1)
    tokens = reference.argsort(dim=-1, descending=True)[:, 1]
    num_top = min(4, vocab)
    logprob, rank, top_ids, top_logprobs = sampling.row_logprobs(
        src, tokens, num_top, temperature, cutoff, block=256
    )
    torch.testing.assert_close(logprob, reference.gather(1, tokens[:, None]).squeeze(1))
    assert rank.tolist() == [2] * rows
    top = reference.topk(num_top, dim=-1)
    finite = top.values > float("-inf")
    assert torch.equal(top_ids[finite], top.indices[finite])
    torch.testing.assert_close(top_logprobs, top.values)


def fused_and_torch(requests, vocab):
    return (
        SamplingState(DEVICE, vocab, fused=True).metadata(requests),
        SamplingState(DEVICE, vocab).metadata(requests),
    )


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_fused_sampler_matches_the_torch_sampler(mode) -> None:
    torch.manual_seed(7)
    vocab = 60
    logits = torch.randn(6, vocab) * 2
    penalised = SamplingParams(
        temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3
    )
    requests = [
        make_request(SamplingParams(**{**penalised.__dict__, "logprobs": 3}), [0, 4], [1, 2, 2]),
        make_request(SamplingParams(temperature=0, logit_bias={7: 5.0}, min_tokens=3, logprobs=2)),
        make_request(SamplingParams(temperature=0, allowed_token_ids=[1, 3, 40], logprobs=0)),
        make_request(SamplingParams(temperature=0, top_k=3, top_p=0.5, logprobs=4)),
        make_request(SamplingParams(temperature=0.7, top_k=1, logprobs=4)),
        make_request(SamplingParams(temperature=0.7, min_p=0.999, logit_bias={9: 50.0})),
    ]
    fused, plain = fused_and_torch(requests, vocab)
    got, expected = Sampler(mode)(logits.clone(), fused), Sampler(mode)(logits.clone(), plain)
    # greedy rows, top_k=1 and a min_p that leaves one token: no randomness
    assert torch.equal(got.sampled_token_ids, expected.sampled_token_ids)
    for got_row, expected_row in zip(got.to_host(fused)[1], expected.to_host(plain)[1]):
        if expected_row is None:
            assert got_row is None
            continue
        assert (got_row.token_id, got_row.rank) == (expected_row.token_id, expected_row.rank)
        assert got_row.logprob == pytest.approx(expected_row.logprob, abs=1e-5)
        finite = [i for i, v in enumerate(expected_row.top_logprobs) if v > float("-inf")]
        assert [got_row.top_ids[i] for i in finite] == [expected_row.top_ids[i] for i in finite]
        assert got_row.top_logprobs == pytest.approx(expected_row.top_logprobs, abs=1e-5)


def test_a_seeded_fused_row_ignores_the_rest_of_the_batch_and_its_order() -> None:
    vocab = 40
    torch.manual_seed(2)
    mine, others = torch.randn(vocab), torch.randn(3, vocab)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    plain = SamplingParams(temperature=0.8, top_k=10)

    def run(row: int, batch_size: int) -> list[int]:
        state = SamplingState(DEVICE, vocab, fused=True)
        params = [plain] * batch_size
        params[row] = seeded
        requests = [make_request(p) for p in params]
        rest = others[: batch_size - 1]
        picked = []
        for _ in range(8):
            meta = state.metadata(requests)
            logits = torch.cat([rest[:row], mine[None], rest[row:]])
            sampled = Sampler()(logits, meta).sampled_token_ids
            state.record_sampled(meta, sampled)
            picked.append(sampled[row].item())
        return picked

    alone = run(0, 1)
    assert run(2, 4) == alone
    assert run(1, 3) == alone
    assert len(set(alone)) > 1
