"""The n-gram (prompt lookup) proposer."""

import pytest

from asyncllm.config import SpeculativeConfig
from asyncllm.spec_decode.ngram import NgramProposer


def proposer(k: int = 3, lo: int = 1, hi: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi))


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
