"""The batched sampler on synthetic logits: distributions, processors, seeds and logprobs."""

import itertools
import math

import pytest
import torch

from asyncllm.request import Request
from asyncllm.sample import batch as batch_module
from asyncllm.sample import sampler as sampler_module
from asyncllm.sample.metadata import SamplingMetadata
from asyncllm.sample.sampler import Sampler, apply_logits_processors, apply_top_k_top_p
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams

EOS = 2
VOCAB = 4096  # above every token id of these tests
_request_ids = itertools.count()


def make_request(params: SamplingParams, prompt=(0, 1), output=(), bad_words=()) -> Request:
    request = Request(str(next(_request_ids)), list(prompt), params, eos_token_ids=frozenset({EOS}))
    request.bad_words_token_ids = [list(w) for w in bad_words]
    for token_id in output:
        request.append_output_token(token_id)
    return request


def build(requests) -> SamplingMetadata:
    """The metadata of a batch that has not sampled before."""
    return SamplingState(torch.device("cpu"), VOCAB).metadata(requests)


def sample(logits: torch.Tensor, params: list[SamplingParams], mode="raw_logprobs"):
    meta = build([make_request(p) for p in params])
    return Sampler(mode)(logits.clone(), meta)


def target_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a request asks for, computed plainly in float64 from its definition."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    keep = probs >= p.min_p * probs.max()
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    if p.top_k > 0:
        for i in order[p.top_k :]:
            keep[i] = False
    kept = [i for i in order if keep[i]]
    mass, before = probs[kept].sum(), 0.0
    for i in kept:
        if p.top_p < 1.0 and before / mass >= p.top_p:
            keep[i] = False
        before += probs[i].item()
    probs = probs * keep
    return probs / probs.sum()


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    support = expected > 0
    statistic = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    dof = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2), statistic / 2).item()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.7),
        SamplingParams(min_p=0.15),
        SamplingParams(temperature=1.4, top_k=5, top_p=0.85, min_p=0.03),
    ],
    ids=["temperature1", "temperature0.6", "top_k", "top_p", "min_p", "all"],
)
def test_sampled_frequencies_match_the_target_distribution(params) -> None:
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 1.1, 0.7, 0.2, -0.3, -1.0, -2.2])
    num_samples = 40_000
    ids = sample(logits.repeat(num_samples, 1), [params] * num_samples).sampled_token_ids
    counts = torch.bincount(ids, minlength=len(logits)).double()
    expected = target_distribution(logits, params) * num_samples
    assert counts[expected == 0].sum() == 0, "a masked token was sampled"
    assert chi_square_p_value(counts, expected) > 1e-3


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 300)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=20),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.2),
    ]
    params = [kinds[i % 4] for i in range(64)]
    ids = sample(logits, params).sampled_token_ids
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(ids[greedy], logits.argmax(dim=-1)[greedy])
    assert not torch.equal(ids[~greedy], logits.argmax(dim=-1)[~greedy])


def test_all_greedy_batch_is_the_argmax() -> None:
    logits = torch.randn(16, 1000)
    assert torch.equal(
        sample(logits, [SamplingParams(temperature=0)] * 16).sampled_token_ids, logits.argmax(-1)
    )


def test_bf16_logits_sample_as_their_float32_widening() -> None:
    """The model's bf16 logits: a greedy batch takes their argmax as they are (ties included),
    and anything that edits or reports works on a float32 copy, leaving them unchanged."""
    torch.manual_seed(5)
    logits = (torch.randn(16, 1000) * 4).round().to(torch.bfloat16)  # many ties per row
    greedy = [SamplingParams(temperature=0)] * 16
    assert torch.equal(
        sample(logits, greedy).sampled_token_ids, sample(logits.float(), greedy).sampled_token_ids
    )
    params = [SamplingParams(temperature=0, logprobs=3, presence_penalty=0.5)] * 2
    meta = build([make_request(p, output=(7,)) for p in params])
    before = logits[:2].clone()
    ours = Sampler()(logits[:2], meta)
    widened = Sampler()(before.float(), build([make_request(p, output=(7,)) for p in params]))
    assert torch.equal(logits[:2], before)
    assert torch.equal(ours.sampled_token_ids, widened.sampled_token_ids)
    assert ours.logprobs.token_logprobs.dtype == torch.float32
    assert torch.equal(ours.logprobs.top_logprobs, widened.logprobs.top_logprobs)


def test_a_seeded_request_ignores_the_rest_of_the_batch_and_its_order() -> None:
    vocab = 500
    torch.manual_seed(2)
    mine = torch.randn(vocab)
    others = torch.randn(3, vocab)
    seeded = SamplingParams(temperature=1.0, seed=77)
    plain = SamplingParams(temperature=0.8, top_p=0.9)

    def run(row: int, batch_size: int) -> list[int]:
        state = SamplingState(torch.device("cpu"), VOCAB)
        params = [plain] * batch_size
        params[row] = seeded
        requests = [make_request(p) for p in params]
        rest = others[: batch_size - 1]
        picked = []
        for _ in range(20):
            logits = torch.cat([rest[:row], mine[None], rest[row:]])
            meta = state.metadata(requests)
            sampled = Sampler()(logits, meta).sampled_token_ids
            state.record_sampled(meta, sampled)
            picked.append(sampled[row].item())
        return picked

    alone = run(0, 1)
    assert run(2, 4) == alone
    assert run(1, 3) == alone
    assert len(set(alone)) > 1


def test_unseeded_rows_differ_between_calls() -> None:
    logits = torch.zeros(4, 1000)
    params = [SamplingParams(temperature=1.0)] * 4
    first, second = (sample(logits, params).sampled_token_ids for _ in range(2))
    assert not torch.equal(first, second)


def test_penalties_change_logits_exactly_as_their_formulas_say() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, -0.5, 3.0], [1.0, 2.0, -1.0, 0.5, -0.5, 3.0]])
    penalized = SamplingParams(
        temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3
    )
    prompt, output = [0, 4], [1, 2, 2]
    requests = [
        make_request(penalized, prompt, output),
        make_request(SamplingParams(temperature=0), prompt, output),
    ]
    got = apply_logits_processors(logits.clone(), build(requests))
    counts = [0, 1, 2, 0, 0, 0]
    expected = []
    for token_id, logit in enumerate(logits[0].tolist()):
        if token_id in prompt or counts[token_id]:  # repetition: HF, over prompt and output
            logit = logit / 1.5 if logit > 0 else logit * 1.5
        logit -= 0.5 * counts[token_id]  # frequency: OpenAI, over output
        logit -= 0.3 * (counts[token_id] > 0)  # presence: OpenAI, over output
        expected.append(logit)
    torch.testing.assert_close(got[0], torch.tensor(expected))
    torch.testing.assert_close(got[1], logits[1])


def test_logit_bias_moves_the_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 0.0, 1.0]])
    biased = SamplingParams(temperature=0, logit_bias={"2": 4.5})
    assert sample(logits, [biased]).sampled_token_ids.tolist() == [2]


def test_allowed_token_ids_restrict_sampling() -> None:
    torch.manual_seed(3)
    logits = torch.randn(2000, 50)
    params = [
        SamplingParams(temperature=2.0, allowed_token_ids=[3, 17, 41]),
        SamplingParams(temperature=2.0),
    ]
    ids = sample(logits, params * 1000).sampled_token_ids
    assert set(ids[0::2].tolist()) == {3, 17, 41}
    assert len(set(ids[1::2].tolist())) > 3


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0, 1.0]] * 3)
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    requests = [
        make_request(params, output=[5]),
        make_request(params, output=[5, 5]),
        make_request(ignoring, output=[5]),
    ]
    ids = Sampler()(logits.clone(), build(requests)).sampled_token_ids
    assert ids.tolist() == [4, EOS, EOS]


def test_bad_words_ban_the_last_token_after_their_prefix() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 8.0, 7.0]] * 3)
    words = [[5], [7, 8]]
    params = SamplingParams(temperature=0)
    requests = [
        make_request(params, output=[1], bad_words=words),  # 5 banned, 8 free
        make_request(params, output=[1, 7], bad_words=words),  # 5 and 8 banned
        make_request(params, output=[1, 7]),
    ]
    ids = Sampler()(logits.clone(), build(requests)).sampled_token_ids
    assert ids.tolist() == [8, 9, 5]


def test_raw_logprobs_are_the_model_log_softmax() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 100)
    params = [
        SamplingParams(temperature=0.5, top_k=5, logprobs=4, presence_penalty=1.0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    out = sample(logits, params)
    reference = torch.log_softmax(logits, dim=-1)
    rows = out.to_host(build([make_request(p) for p in params]))[1]
    for i, row in enumerate(rows[:2]):
        chosen = out.sampled_token_ids[i]
        assert row.token_id == chosen.item()
        assert row.logprob == pytest.approx(reference[i, chosen].item(), abs=1e-5)
        assert row.rank == int((reference[i] > reference[i, chosen]).sum()) + 1
        top = reference[i].topk(params[i].logprobs)
        assert row.top_ids == top.indices.tolist()
        assert row.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    assert rows[1].rank == 1 and rows[1].top_ids == []
    assert rows[2] is None


def test_processed_logprobs_follow_the_sampled_distribution() -> None:
    torch.manual_seed(5)
    logits = torch.randn(1, 100)
    params = SamplingParams(temperature=0.5, top_k=5, logprobs=8)
    out = sample(logits, [params], mode="processed_logprobs")
    scaled = logits[0] / 0.5
    kept = scaled.topk(5).indices
    expected = torch.full_like(scaled, float("-inf"))
    expected[kept] = torch.log_softmax(scaled[kept], dim=-1)
    chosen = out.sampled_token_ids[0].item()
    assert chosen in kept.tolist()
    torch.testing.assert_close(out.logprobs.token_logprobs[0], expected[chosen])
    torch.testing.assert_close(out.logprobs.top_logprobs[0], expected.topk(8).values)


def test_chi_square_helper_rejects_a_wrong_distribution() -> None:
    expected = torch.tensor([0.5, 0.3, 0.2]) * 10_000
    assert chi_square_p_value(torch.tensor([5200.0, 2800.0, 2000.0]), expected) < 1e-3
    assert math.isclose(chi_square_p_value(expected.clone(), expected), 1.0)


@pytest.mark.parametrize("scale", [6.0, 0.1], ids=["mass-in-candidates", "needs-full-sort"])
def test_top_k_top_p_keep_exactly_the_defined_tokens(monkeypatch, scale) -> None:
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", 16)
    torch.manual_seed(6)
    logits = torch.randn(4, 300) * scale
    top_k, top_p = [0, 5, 0, 40], [0.8, 0.9, 1.0, 0.5]
    kept = apply_top_k_top_p(logits.clone(), torch.tensor(top_k), torch.tensor(top_p), 40) > float(
        "-inf"
    )
    for row in range(4):
        params = SamplingParams(top_k=top_k[row], top_p=top_p[row])
        assert torch.equal(kept[row], target_distribution(logits[row], params) > 0)


def record_steps(state: SamplingState, requests, steps: list[list[int]]) -> None:
    """Steps that sampled these ids, recorded on the device only: the host lists stay as they are."""
    for token_ids in steps:
        state.record_sampled(state.metadata(requests), torch.tensor(token_ids))


@pytest.fixture
def device(fused: bool):
    """The fused sampler's kernels run on the GPU when there is one (else the interpreter);
    tensors made without a device go there too."""
    device = torch.device("cuda" if fused and torch.cuda.is_available() else "cpu")
    with device:
        yield device


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_penalties_follow_the_recorded_ids_not_the_host_lists(fused, device) -> None:
    vocab = 12
    logits = torch.linspace(-2.0, 3.0, vocab).repeat(2, 1)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, logprobs=5),
        SamplingParams(temperature=0, presence_penalty=0.7, logprobs=5),
    ]
    state = SamplingState(device, vocab_size=vocab, fused=fused)
    requests = [make_request(p, prompt=[4], output=[9]) for p in params]
    record_steps(state, requests, [[11, 10], [11, 11]])
    caught_up = [make_request(p, prompt=[4], output=[9, 11, 11]) for p in params]
    caught_up[1].output_token_ids[1:] = [10, 11]
    mode = "processed_logprobs"
    got = Sampler(mode)(logits.clone(), state.metadata(requests))
    meta = build(caught_up)  # the torch sampler on CPU, from the caught-up host lists
    expected = Sampler(mode)(logits.cpu(), meta)
    assert torch.equal(got.sampled_token_ids.cpu(), expected.sampled_token_ids)
    torch.testing.assert_close(got.logprobs.top_logprobs.cpu(), expected.logprobs.top_logprobs)
    assert torch.equal(got.logprobs.top_ids.cpu(), expected.logprobs.top_ids)


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_bans_follow_the_recorded_ids_not_the_host_lists(fused, device) -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.5, 0.0, 7.0, 0.0, 0.0, 8.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[3])
    state = SamplingState(device, vocab_size=10, fused=fused)
    request = make_request(params, bad_words=[[7, 8]])

    def next_token() -> int:
        meta = state.metadata([request])
        token_id = Sampler()(logits.clone(), meta).sampled_token_ids
        state.record_sampled(meta, token_id)
        return token_id.item()

    assert next_token() == 8  # EOS and stop 3 banned; 8 free: the output does not end in 7
    record_steps(state, [request], [[7]])
    assert next_token() == 5  # stops still banned, and 8 after 7 is
    assert next_token() == EOS  # three tokens out
    assert request.output_token_ids == []


def test_a_forgotten_request_starts_again_from_its_host_lists() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    request = make_request(SamplingParams(temperature=0, frequency_penalty=2.0))
    state = SamplingState(torch.device("cpu"), VOCAB)
    record_steps(state, [request], [[2], [2]])  # 3.0 - 2 x 2.0 puts token 1 first
    assert Sampler()(logits.clone(), state.metadata([request])).sampled_token_ids.item() == 1
    state.forget([request.request_id])  # e.g. preempted: its in-flight token is dropped
    assert Sampler()(logits.clone(), state.metadata([request])).sampled_token_ids.item() == 2


def test_a_batch_goes_to_the_device_in_one_copy_per_dtype(monkeypatch) -> None:
    copies, to_device = [], batch_module.to_device

    def counted(values, device):
        copies.append(str(values.dtype))
        return to_device(values, device)

    monkeypatch.setattr(batch_module, "to_device", counted)
    everything = SamplingParams(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.1,
        seed=3,
        logit_bias={4: 1.0},
        allowed_token_ids=[4, 5, 6],
        min_tokens=2,
        stop_token_ids=[7],
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logprobs=2,
    )
    requests = [make_request(everything, output=[1], bad_words=[[5], [1, 6]])]
    build(requests + [make_request(SamplingParams())])
    assert sorted(copies) == ["float32", "int64"]


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_a_seeded_request_keeps_its_draws_when_the_batch_changes(fused, device) -> None:
    vocab = 30
    torch.manual_seed(8)
    mine, others = torch.randn(vocab), torch.randn(2, vocab)
    seeded = SamplingParams(temperature=1.0, seed=5)

    def run(batch_from: int) -> list[int]:
        state = SamplingState(device, vocab_size=vocab, fused=fused)
        request = make_request(seeded)
        company = [make_request(SamplingParams()) for _ in range(2)]
        picked = []
        for step in range(6):
            requests = [request] + (company if step >= batch_from else [])
            meta = state.metadata(requests)
            logits = torch.cat([mine[None], others[: len(requests) - 1]])
            sampled = Sampler()(logits, meta).sampled_token_ids
            state.record_sampled(meta, sampled)
            picked.append(sampled[0].item())
        return picked

    assert run(batch_from=3) == run(batch_from=6)
