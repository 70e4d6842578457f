"""Speculation that runs ahead: with drafts made on the device and async scheduling, a request's
next verify step is scheduled while its last one runs (its input token, its drafts and how far
back it starts all come from the device), and the outputs are those of decoding without drafts.
On a CUDA device (float32: a verify step's shapes round differently from a decode step's in
bf16) the same tests run the verify graphs."""

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.core.scheduler_output import DRAFT_ON_DEVICE, ScheduledRequest, SchedulerOutput
from asyncllm.request import Request
from asyncllm.spec_decode.draft_step import DraftBatch
from asyncllm.worker.input_batch import DeviceTokens, InputBatch
from bench.spec_decode import install_device_proposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
PROMPTS = [
    {"prompt_token_ids": [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]},
    {"prompt_token_ids": [7]},
    {"prompt_token_ids": [9, 9, 10, 11, 12, 9, 9]},
]
VOCAB = 32
ENGINE = dict(
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    async_scheduling=True,
    dtype="float32",
)


class BigramProposer:
    """Drafts on the device by chaining a table of the token that followed each token in a
    reference output: often right, often wrong (-1 where a token never had a follower)."""

    drafts_on_device = True
    reads_hidden = False
    aux_layers: tuple[int, ...] = ()

    def __init__(self, outputs: list[list[int]], k: int) -> None:
        # one entry past the vocabulary: a -1 draft indexes it and stays -1
        self.table = torch.full((VOCAB + 1,), -1, dtype=torch.int64)
        for tokens in outputs:
            for before, after in zip(tokens, tokens[1:]):
                self.table[before] = after
        self.k = k

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        self.table = self.table.to(batch.next_token_ids.device)
        drafts, token = [], batch.next_token_ids
        for _ in range(self.k):
            token = self.table[token]
            drafts.append(token)
        return torch.stack(drafts, dim=1)


def generate(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def run_ahead_engine(model_dir, reference: list, **kwargs) -> tuple[LLM, list]:
    """An engine speculating with BigramProposer, and the rows of each step it launches as
    (request id, whether the row was scheduled ahead)."""
    llm = LLM(**ENGINE, model=str(model_dir), speculative_config=NGRAM, **kwargs)
    install_device_proposer(llm, BigramProposer([o.token_ids for o in reference], k=4))
    executor, steps = llm.core_client.core.executor, []
    launch = executor.execute_model

    def recorded(scheduler_output):
        steps.append(
            [(s.request.request_id, s.drafts_on_device) for s in scheduler_output.scheduled]
        )
        return launch(scheduler_output)

    executor.execute_model = recorded
    return llm, steps


def ahead_rows(steps: list) -> int:
    return sum(ahead for step in steps for _, ahead in step)


@pytest.fixture(scope="module")
def plain(small_vocab_dir):
    return LLM(**ENGINE, model=str(small_vocab_dir))


def test_greedy_run_ahead_gives_the_tokens_of_decoding_without_drafts(plain, small_vocab_dir):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = generate(plain, params)
    spec, steps = run_ahead_engine(small_vocab_dir, want)
    got = generate(spec, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = spec.core_client.core.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some rejected, some not
    assert ahead_rows(steps) > len(steps)  # nearly every row of every step ran ahead


def test_logprobs_stops_and_max_tokens_inside_a_verify_step_run_ahead(plain, small_vocab_dir):
    """A request that stops part way through a verify step takes its tokens up to the stop;
    the step already scheduled behind it is dropped."""
    reference = generate(plain, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stop = reference[0].token_ids[17]
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop], logprobs=2),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=29, ignore_eos=True),
    ]
    want = [o.outputs[0] for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    spec, steps = run_ahead_engine(small_vocab_dir, reference)
    got = [o.outputs[0] for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert [(o.token_ids, o.finish_reason) for o in got] == [
        (o.token_ids, o.finish_reason) for o in want
    ]
    for a, b in zip(got[:2], want[:2]):
        assert [{t: (p.rank, p.logprob) for t, p in d.items()} for d in a.logprobs] == [
            {t: (p.rank, pytest.approx(p.logprob, abs=1e-4)) for t, p in d.items()}
            for d in b.logprobs
        ]
    assert ahead_rows(steps) > 0


def test_run_ahead_under_preemption_gives_the_same_tokens(plain, small_vocab_dir):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = PROMPTS * 2
    want = generate(plain, params, prompts)
    spec, steps = run_ahead_engine(small_vocab_dir, want, num_kv_blocks=14)
    got = generate(spec, params, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.core_client.core.scheduler.num_preemptions > 0
    assert ahead_rows(steps) > 0


def test_requests_that_count_their_tokens_wait_for_their_step(plain, small_vocab_dir):
    """Seeded and penalised requests are not scheduled ahead (their sampling reads the count
    of their tokens, or the tokens themselves); the greedy one beside them is."""
    params = [
        SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    want = [o.outputs[0] for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    spec, steps = run_ahead_engine(small_vocab_dir, want)
    got = [o.outputs[0] for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    ahead = {request_id for step in steps for request_id, ahead in step if ahead}
    assert len(ahead) == 1  # the greedy request's id; the others never ran ahead


def test_prefix_cache_holds_only_accepted_tokens(plain, small_vocab_dir):
    """A prompt that continues a speculated output hits the blocks the output filled: their
    KV is that of the accepted tokens, so the answer is the one computed from scratch."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = generate(plain, params)
    spec, _ = run_ahead_engine(small_vocab_dir, want)
    first = generate(spec, params, PROMPTS[:1])
    longer = [{"prompt_token_ids": PROMPTS[0]["prompt_token_ids"] + first[0].token_ids[:30]}]
    core = spec.core_client.core
    hits = core.kv_cache_manager.prefix_cache_hits
    got = generate(spec, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), longer)
    assert core.kv_cache_manager.prefix_cache_hits > hits
    fresh = LLM(**ENGINE, model=str(small_vocab_dir), enable_prefix_caching=False)
    expected = generate(
        fresh, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), longer
    )
    assert got[0].token_ids == expected[0].token_ids


def test_a_row_run_ahead_takes_its_token_and_drafts_and_moves_back_by_the_rejected():
    """Its step before verified 3 drafts from position 4 and rejected 2 of them: it starts at
    6, not 8, with the token sampled there and the drafts proposed after it."""
    batch = InputBatch(
        max_num_reqs=4, max_num_tokens=16, max_model_len=64, block_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), max_tokens=8)
    request.num_output_placeholders = 1
    step = SchedulerOutput([ScheduledRequest(request, 3, 8, [5, 6, 7], [DRAFT_ON_DEVICE] * 2)])
    previous = DeviceTokens(
        torch.tensor([40, 41]),
        {"other": 0, "r": 1},
        drafts=torch.tensor([[0, 0, 0], [17, 18, 19]]),
        num_rejected=torch.tensor([0, 2]),
    )
    inputs = batch.prepare(step, previous=previous)
    assert inputs.input_ids.tolist() == [41, 17, 18]
    assert inputs.positions.tolist() == [6, 7, 8]
    # positions 6, 7 in block 6 (slots 26, 27), 8 in block 7 (slot 28)
    assert inputs.meta.slot_mapping.tolist() == [26, 27, 28]
    assert inputs.meta.seq_lens.tolist() == inputs.meta.seq_lens_cpu == [9]
