"""The n-gram (prompt lookup) proposer, which drafts on the device from the tokens it keeps."""

import pytest
import torch

from asyncllm.config import SpeculativeConfig
from asyncllm.spec_decode.draft_step import DraftBatch
from asyncllm.spec_decode.ngram import NgramProposer

NONE = torch.zeros(0, dtype=torch.int64)


class Proposer:
    """Drafts for requests given whole: each new to its row, its last token just sampled."""

    def __init__(self, k: int = 3, lo: int = 1, hi: int = 3) -> None:
        config = SpeculativeConfig("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi)
        self.ngram = NgramProposer(config, num_rows=4, max_model_len=64, device=torch.device("cpu"))

    def propose_all(self, *requests: list[int]) -> list[list[int]]:
        batch = DraftBatch(
            input_ids=NONE,
            positions=NONE,
            token_rows=NONE,
            known=[(row, tokens[:-1]) for row, tokens in enumerate(requests)],
            rows=torch.arange(len(requests)),
            next_token_ids=torch.tensor([tokens[-1] for tokens in requests]),
            next_positions=torch.tensor([len(tokens) - 1 for tokens in requests]),
            max_len=max(len(tokens) for tokens in requests),
            hidden=None,
            sampled_rows=NONE,
        )
        drafts = self.ngram.propose(batch).tolist()
        return [row[: row.index(-1)] if -1 in row else row for row in drafts]

    def propose(self, tokens: list[int]) -> list[int]:
        return self.propose_all(tokens)[0]


def proposer(k: int = 3, lo: int = 1, hi: int = 3) -> Proposer:
    return Proposer(k, lo, hi)


def test_the_tokens_after_the_latest_earlier_match_are_proposed():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 6, 1, 2, 3]
    assert proposer().propose(tokens) == [8, 7, 6]


def test_the_longest_ngram_wins_over_a_later_shorter_one():
    # [2, 3] last occurs at 5, but [1, 2, 3] only at 0
    tokens = [1, 2, 3, 4, 5, 2, 3, 6, 1, 2, 3]
    assert proposer().propose(tokens) == [4, 5, 2]
    assert proposer(lo=1, hi=2).propose(tokens) == [6, 1, 2]


def test_a_match_near_the_end_proposes_fewer_tokens():
    assert proposer(k=5).propose([4, 5, 4, 5]) == [4, 5]


def test_no_recurring_ngram_proposes_nothing():
    assert proposer().propose([1, 2, 3, 4]) == []
    assert proposer(lo=2).propose([1, 2, 3, 2]) == []
    assert proposer().propose([7]) == []


def test_requests_drafted_together_get_what_each_gets_alone():
    requests = [[1, 2, 3, 9, 1, 2, 3, 8, 7, 6, 1, 2, 3], [4, 5, 4, 5], [7], [1, 2, 3, 4]]
    together = proposer(k=5).propose_all(*requests)
    assert together == [proposer(k=5).propose(tokens) for tokens in requests]
    assert together == [[8, 7, 6, 1, 2], [4, 5], [], []]


def test_the_tokens_come_from_the_steps_inputs_and_samples():
    """A prompt step then a verify step that accepted one draft: the table holds what the
    device computed, and the drafts follow the sampled token."""
    ngram = proposer().ngram
    prompt = [5, 6, 7, 1, 5, 6]
    step = DraftBatch(
        input_ids=torch.tensor(prompt),
        positions=torch.arange(6),
        token_rows=torch.zeros(6, dtype=torch.int64),
        known=[(0, [])],
        rows=torch.tensor([0]),
        next_token_ids=torch.tensor([9]),
        next_positions=torch.tensor([6]),
        max_len=7,
        hidden=None,
        sampled_rows=NONE,
    )
    assert ngram.propose(step).tolist() == [[-1, -1, -1]]  # 5 6 7 1 5 6 9: 9 is new
    # the verify step's inputs: 9 and its drafts 5 and 4 (5 accepted), then 6 sampled
    verify = DraftBatch(
        input_ids=torch.tensor([9, 5, 4]),
        positions=torch.tensor([6, 7, 8]),
        token_rows=torch.zeros(3, dtype=torch.int64),
        known=[],
        rows=torch.tensor([0]),
        next_token_ids=torch.tensor([6]),
        next_positions=torch.tensor([8]),
        max_len=9,
        hidden=None,
        sampled_rows=NONE,
    )
    # 5 6 7 1 5 6 9 5 6: the trigram 9 5 6 has no match, the bigram 5 6 last at 4
    assert ngram.propose(verify).tolist() == [[9, 5, 6]]


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The rule, one window at a time."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def test_random_requests_get_the_rules_drafts():
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        lengths = torch.randint(1, 30, (4,), generator=generator).tolist()
        requests = [torch.randint(0, 4, (n,), generator=generator).tolist() for n in lengths]
        k, lo, hi = 1 + trial % 4, 1 + trial % 2, 2 + trial % 3
        want = [reference(tokens, k, lo, hi) for tokens in requests]
        assert proposer(k, lo, hi).propose_all(*requests) == want


@pytest.mark.parametrize("bad", [{"prompt_lookup_min": 0}, {"prompt_lookup_min": 4}])
def test_lookup_bounds_are_checked(bad):
    with pytest.raises(ValueError, match="prompt_lookup"):
        SpeculativeConfig("ngram", 3, **bad)


def test_the_config_parses_vllm_json():
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}'
    )
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == (
        "ngram",
        4,
        5,
    )
    assert SpeculativeConfig.parse(None) is None
    with pytest.raises(ValueError, match="unknown keys: colour"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 1, "colour": 1})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.parse({"method": "guess", "num_speculative_tokens": 1})
