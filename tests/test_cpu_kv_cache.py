"""The CPU KV cache holds what the configuration can use (max_num_seqs sequences of
max_model_len tokens), bounded by a budget but never below one whole sequence; --kv-cache-memory
and --num-kv-blocks set it outright."""

from __future__ import annotations

import pytest

from asyncllm import LLM
from asyncllm.worker import model_runner

BLOCKS_PER_SEQUENCE = 512 // 16  # max_model_len 512, block_size 16
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 heads of 16, fp32


def num_blocks(tiny_model_dir, **kwargs) -> int:
    llm = LLM(model=str(tiny_model_dir), max_model_len=512, **kwargs)
    return llm.core_client.capacity.num_blocks


def test_sized_from_max_num_seqs_times_max_model_len(tiny_model_dir) -> None:
    assert num_blocks(tiny_model_dir, max_num_seqs=4) == 4 * BLOCKS_PER_SEQUENCE


def test_bounded_but_never_below_one_sequence(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(model_runner, "_CPU_KV_CACHE_BYTES", 40 * BYTES_PER_BLOCK)
    assert num_blocks(tiny_model_dir, max_num_seqs=8) == 40
    monkeypatch.setattr(model_runner, "_CPU_KV_CACHE_BYTES", 3 * BYTES_PER_BLOCK)
    assert num_blocks(tiny_model_dir, max_num_seqs=8) == BLOCKS_PER_SEQUENCE


def test_kv_cache_memory_sets_it(tiny_model_dir) -> None:
    assert num_blocks(tiny_model_dir, kv_cache_memory=10 * BYTES_PER_BLOCK) == 10


def test_start_reports_the_size(tiny_model_dir, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="asyncllm.worker.model_runner"):
        num_blocks(tiny_model_dir, max_num_seqs=2)
    assert f"KV cache: {2 * BLOCKS_PER_SEQUENCE} blocks of 16 tokens" in caplog.text
