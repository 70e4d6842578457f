"""The sizes CUDA graphs are captured at: every step fits one, with bounded padding."""

from asyncllm.worker.cuda_graph import batch_size_ladder, token_count_ladder


def test_decode_batch_sizes_cover_every_batch() -> None:
    sizes = batch_size_ladder(100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100
    assert all(next(s for s in sizes if s >= n) - n < 8 for n in range(1, 101))


def test_token_counts_cover_steps_up_to_the_cap_with_under_a_quarter_of_padding() -> None:
    for max_tokens in (100, 512, 1000, 2048, 8192):
        sizes = token_count_ladder(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(max_tokens, 2048)
        for n in range(1, sizes[-1] + 1):
            size = next(s for s in sizes if s >= n)
            assert size <= max_tokens
            assert size - n < 64 or (size - n) * 4 < n
    assert token_count_ladder(2000, cap=512)[-1] == 512
