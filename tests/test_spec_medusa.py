"""Medusa heads with random weights, in vLLM's layout and the Medusa authors': greedy
speculation gives exactly the target's own tokens, each head guessing one more token ahead."""

import pytest
import torch
import torch.nn.functional as F
from test_spec_eagle_support import (
    GREEDY,
    HIDDEN,
    NUM_HEADS,
    SEEDED,
    VOCAB,
    Target,
    drafter,
    generate,
    medusa_config,
    medusa_tensors,
    random,
    record_device_drafts,
    spec_stats,
    speculate,
    write_head,
    write_heads,
)

from asyncllm import SamplingParams


@pytest.fixture(scope="module")
def target(default_model_dir, tmp_path_factory):
    return Target.write(default_model_dir, tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def medusa_dir(tmp_path_factory):
    return write_heads("medusa", tmp_path_factory.mktemp("medusa"))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_and_seeded_give_the_targets_own_tokens(target, medusa_dir, async_scheduling):
    """With async scheduling the heads draft on the device and the greedy request's verify
    steps run ahead of each other."""
    spec = speculate(target, "medusa", medusa_dir, NUM_HEADS, async_scheduling=async_scheduling)
    assert generate(spec, GREEDY) == target.greedy
    assert generate(spec, SEEDED) == target.seeded
    assert spec_stats(spec).num_draft_tokens > 0


def medusa_reference(hf_target, tensors, tokens: list[int], num_drafts: int) -> list[int]:
    """Head i on the target's final state before the next token: x + silu(W x + b), then
    its lm_head."""
    with torch.no_grad():
        state = hf_target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0, -1]
        drafts = []
        for i in range(num_drafts):
            block = f"blocks.{i}.layers.0"
            x = state + F.silu(state @ tensors[f"{block}.weight"].T + tensors[f"{block}.bias"])
            drafts.append(int((x @ tensors[f"lm_heads.{i}.weight"].T).argmax()))
    return drafts


@pytest.mark.parametrize("authors_layout", [False, True])
def test_drafts_are_the_heads_guesses(target, tmp_path, monkeypatch, authors_layout):
    from asyncllm.spec_decode.medusa import MedusaProposer

    torch.manual_seed(5)
    tensors = medusa_tensors()
    saved = tensors
    if authors_layout:  # the same weights under the authors' names, in their config keys
        saved = {_authors_name(name): t for name, t in tensors.items()}
        config = medusa_config(medusa_num_heads=NUM_HEADS, medusa_num_layers=1)
    else:
        config = medusa_config(architectures=["MedusaModel"], num_heads=NUM_HEADS)
    head_dir = write_head(tmp_path / "heads", config, saved)
    drafted = record_device_drafts(monkeypatch, MedusaProposer)
    prompt = list(range(3, 14))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    output = speculate(target, "medusa", head_dir, NUM_HEADS).generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False
    )
    tokens = prompt + list(output[0].outputs[0].token_ids)
    assert sum(len(drafts) for _, drafts in drafted) > 6
    for position, drafts in drafted:
        want = medusa_reference(target.hf, tensors, tokens[: position + 1], len(drafts))
        assert drafts == want


def _authors_name(name: str) -> str:
    """The authors' head i is Sequential(ResidualBlock(linear), lm_head): i.0.linear, i.1."""
    head = name.split(".")[1]
    if name.startswith("blocks."):
        return f"{head}.0.linear.{name.rsplit('.', 1)[1]}"
    return f"{head}.1.weight"


def test_heads_of_a_truncated_vocabulary_draft_from_its_tokens(target, tmp_path):
    """truncated_vocab_size heads over the tokens token_map lists, as target ids."""
    torch.manual_seed(8)
    token_map = torch.randperm(VOCAB)[:12].sort().values
    tensors = medusa_tensors()
    tensors |= {f"lm_heads.{i}.weight": random(12, HIDDEN) * 5 for i in range(NUM_HEADS)}
    config = medusa_config(num_heads=NUM_HEADS, truncated_vocab_size=12)
    head_dir = write_head(tmp_path, config, tensors | {"token_map": token_map})
    spec = speculate(target, "medusa", head_dir, NUM_HEADS)
    assert generate(spec, GREEDY) == target.greedy
    heads = drafter(spec).heads
    guesses = heads.draft_token_ids(torch.randn(64, HIDDEN), NUM_HEADS)
    assert set(guesses.flatten().tolist()) <= set(token_map.tolist())
    assert spec_stats(spec).num_draft_tokens > 0


def test_more_drafts_than_heads_are_refused(target, medusa_dir):
    with pytest.raises(ValueError, match="exceeds the 3 Medusa heads"):
        speculate(target, "medusa", medusa_dir, 4)
