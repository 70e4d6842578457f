"""The verify step's metadata: each row's settings at every one of its scored positions."""

import torch

from asyncllm.request import Request
from asyncllm.sample.edits import apply_token_edits
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams
from asyncllm.spec_decode.verify import (
    DraftLayout,
    LayoutTensors,
    counts_moved_on,
    repeat_metadata,
)

VOCAB = 40
CPU = torch.device("cpu")


def metadata(params: list[SamplingParams]):
    requests = [Request(str(i), [1, 2, 3], p) for i, p in enumerate(params)]
    return SamplingState(CPU, VOCAB, fused=False).metadata(requests)


def test_every_position_gets_its_rows_logit_bias_and_allowed_tokens():
    params = [
        SamplingParams(logit_bias={3: 2.5, 7: -1.0}),
        SamplingParams(),
        SamplingParams(allowed_token_ids=[4, 5, 9], logit_bias={5: 1.5}),
        SamplingParams(allowed_token_ids=[11]),
    ]
    drafts = [[1, 2], [], [6, 7, 8], [11]]
    layout = DraftLayout.of(drafts)
    repeated = repeat_metadata(metadata(params), layout, LayoutTensors.of(layout, CPU))
    logits = torch.randn(sum(layout.counts), VOCAB)
    got = logits.clone()
    apply_token_edits(got, repeated)
    # each row's edits alone, on zeros: what its positions must have added
    for row, p in enumerate(params):
        alone = torch.zeros(1, VOCAB)
        apply_token_edits(alone, metadata([p]))
        start, n = layout.starts[row], layout.counts[row]
        assert torch.equal(got[start : start + n], logits[start : start + n] + alone)


def test_the_drafts_are_read_from_the_scored_inputs_and_each_position_knows_its_row():
    drafts = [[5, 6], [], [7, 8, 9]]
    layout = DraftLayout.of(drafts)
    tensors = LayoutTensors.of(layout, CPU)
    assert tensors.owner.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert tensors.offset.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    # each row's last token (40, 41, 42), then its drafts: the inputs of its scored positions
    scored_ids = torch.tensor([40, 5, 6, 41, 42, 7, 8, 9])
    assert tensors.proposed(scored_ids).tolist() == [[5, 6, -2], [-2, -2, -2], [7, 8, 9]]


def test_only_requests_whose_sampling_reads_their_count_restart_after_drafts():
    params = [SamplingParams(seed=3), SamplingParams(min_tokens=2), SamplingParams()]
    requests = [Request(str(i), [1], p) for i, p in enumerate(params)] * 2
    drafts = [[1], [1], [1], [], [], []]
    assert counts_moved_on(requests, drafts) == ["0", "1"]
