"""The sizes CUDA graphs are captured at: every step fits one, with bounded padding."""

from types import SimpleNamespace

from asyncllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from asyncllm.request import Request
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.cuda_graph import batch_size_ladder, token_count_ladder
from asyncllm.worker.model_runner import ModelRunner


def test_decode_batch_sizes_cover_every_batch() -> None:
    sizes = batch_size_ladder(100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100
    assert all(next(s for s in sizes if s >= n) - n < 8 for n in range(1, 101))


def test_token_counts_cover_steps_up_to_the_cap_with_under_a_quarter_of_padding() -> None:
    for max_tokens in (100, 512, 1000, 2048, 3000, 8192, 20000):
        sizes = token_count_ladder(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(max_tokens, 16384)
        for n in range(1, sizes[-1] + 1):
            size = next(s for s in sizes if s >= n)
            assert size <= max_tokens
            assert size - n < 64 or (size - n) * 4 < n
    assert token_count_ladder(2000, cap=512)[-1] == 512


def test_decode_graphs_take_one_token_steps_unless_a_prompt_token_is_scored() -> None:
    """A request asking for prompt_logprobs decodes in the graphs once its prompt is done;
    a one-token chunk inside its prompt still needs the hidden states."""
    runner = SimpleNamespace(decode_sizes=batch_size_ladder(16))

    def decode_size(computed: int, logprobs: int | None) -> int | None:
        request = Request("r", list(range(10, 20)), SamplingParams(prompt_logprobs=logprobs))
        step = SchedulerOutput([ScheduledRequest(request, 1, computed, [0])])
        return ModelRunner._decode_batch_size(runner, step, ModelRunner._prompt_spans(runner, step))

    assert decode_size(10, 2) == 1
    assert decode_size(9, 2) == 1  # the last prompt token
    assert decode_size(5, 2) is None
    assert decode_size(5, None) == 1
