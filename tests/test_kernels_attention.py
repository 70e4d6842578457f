"""Paged attention kernels and the KV cache write against float64 references.

On CPU these run under TRITON_INTERPRET=1 (set in conftest.py) at small sizes in fp32 and fp16
(the interpreter cannot compute bf16); with a GPU the cases widen to every dtype and longer contexts.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.torch_backend import TorchAttentionBackend, gather_kv, write_kv_cache
from asyncllm.attention.triton_backend import TritonAttentionBackend
from kernels import (
    choose_decode_split,
    decode_attention,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)
from kernels.decode_attention import (
    LONG_SPLIT_TOKENS,
    LONG_TILE_MIN_SEQS,
    DecodeSplit,
    default_decode_config,
)
from kernels.prefill_attention import default_prefill_config, short_query_prefill_config

FULL = torch.cuda.is_available()
DEVICE = "cuda" if FULL else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if FULL else [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NEEDS_CUDA = pytest.mark.skipif(not FULL, reason="CUDA graphs need a GPU")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    padding_tokens: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random query/key/value and a random cache whose blocks are scattered across the pool."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(query_lens) + padding_tokens
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_req) + 2
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots = []
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        table = [ids.pop() for _ in range(blocks_per_req[r])]
        block_tables[r, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(s_len - q_len, s_len)
        ]
    slot_mapping = torch.tensor(slots + [-1] * padding_tokens, dtype=torch.int64)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    query = randn(num_tokens, num_heads, head_dim)
    key = randn(num_tokens, num_kv_heads, head_dim)
    value = randn(num_tokens, num_kv_heads, head_dim)
    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(query), to(key), to(value), to(kv_cache), meta


def reference_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal paged attention in float64, one request at a time."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    start = 0
    for r, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        k, v = (t.double() for t in gather_kv(kv_cache, meta.block_tables[r], s_len))
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q = query[start : start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        visible = torch.arange(s_len, device=query.device)[None, :] <= q_pos
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def test_reshape_and_cache_matches_torch_and_skips_padding() -> None:
    query_lens, seq_lens = [3, 1, 20], [3, 17, 40]
    _, key, value, kv_cache, meta = make_batch(
        query_lens, seq_lens, 4, 2, 64, torch.float32, padding_tokens=3
    )
    # strided views, as a fused qkv projection hands them over
    fused = torch.cat([key, value], dim=1)
    key, value = fused[:, :2], fused[:, 2:]
    expected = kv_cache.clone()
    write_kv_cache(key, value, expected, meta.slot_mapping)
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_dtypes(dtype: torch.dtype) -> None:
    _, key, value, kv_cache, meta = make_batch([5, 9], [21, 9], 8, 8, 128, dtype, padding_tokens=2)
    expected = kv_cache.clone()
    write_kv_cache(key, value, expected, meta.slot_mapping)
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    assert torch.equal(kv_cache, expected)


DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, dtype, num_splits, block_size)
    (2, 2, 64, torch.float32, 1, 16),
    (8, 2, 128, torch.float32, 3, 16),
    (16, 2, 64, torch.float32, None, 32),
    (8, 2, 64, torch.float16, 2, 16),
]
if FULL:
    DECODE_CASES = [
        (heads * group, heads, head_dim, dtype, splits, 16 if head_dim == 128 else 32)
        for heads, group in [(2, 1), (2, 4), (1, 8), (8, 2), (2, 3)]
        for head_dim in (64, 128)
        for dtype in DTYPES
        for splits in (1, 5, None)
    ]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,dtype,num_splits,block_size", DECODE_CASES
)
def test_decode_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int | None,
    block_size: int,
) -> None:
    rng = random.Random(head_dim + num_heads)
    seq_lens = [1, 16, 17, 31, 130] + ([rng.randint(1, 3000) for _ in range(27)] if FULL else [])
    query, _, _, kv_cache, meta = make_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size
    )
    scale = head_dim**-0.5
    out = paged_decode_attention(
        query,
        kv_cache,
        meta.block_tables,
        meta.seq_lens,
        scale,
        max_seq_len=meta.max_seq_len,
        num_splits=num_splits,
    )
    assert relative_error(out, reference_attention(query, kv_cache, meta, scale)) < TOLERANCE[dtype]


def test_decode_of_a_big_batch_in_long_tiles_matches_reference() -> None:
    """From LONG_TILE_MIN_SEQS sequences on, 16-bit queries read keys in 128-key tiles."""
    assert default_decode_config(torch.float16, LONG_TILE_MIN_SEQS).block_n == 128
    assert default_decode_config(torch.float16, LONG_TILE_MIN_SEQS - 1).block_n == 64
    rng = random.Random(0)
    seq_lens = [1, 127, 128, 129, 300] + [
        rng.randint(1, 300) for _ in range(LONG_TILE_MIN_SEQS - 5)
    ]
    query, _, _, kv_cache, meta = make_batch(
        [1] * len(seq_lens), seq_lens, 4, 2, 64, torch.float16, 16
    )
    out = paged_decode_attention(query, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    expected = reference_attention(query, kv_cache, meta, 0.125)
    assert relative_error(out, expected) < TOLERANCE[torch.float16]


def test_num_splits_only_when_sms_would_idle() -> None:
    assert choose_decode_split(256, 8, 4096, sms=132) == DecodeSplit(1)
    assert choose_decode_split(4, 8, 200, sms=132) == DecodeSplit(1)
    assert choose_decode_split(4, 8, 16384, sms=132) == DecodeSplit(9)
    assert choose_decode_split(1, 1, 1 << 20, sms=132) == DecodeSplit(64)


def test_long_sequences_split_until_the_sms_have_several_programs() -> None:
    # a decode graph's batch of 32 at max_model_len 40,960: 256 programs, 5 pieces each, none
    # shorter than LONG_SPLIT_TOKENS
    assert choose_decode_split(32, 8, 40960, sms=132) == DecodeSplit(5, LONG_SPLIT_TOKENS)
    assert choose_decode_split(64, 8, 40960, sms=132) == DecodeSplit(3, LONG_SPLIT_TOKENS)
    # enough programs already, or pieces that would be too short: as before
    assert choose_decode_split(256, 8, 40960, sms=132).num_splits == 1
    assert choose_decode_split(32, 8, 4096, sms=132).num_splits == 1
    assert choose_decode_split(32, 8, 8192, sms=132).num_splits == 2


def test_pieces_of_a_minimum_length_leave_short_sequences_whole(monkeypatch) -> None:
    """Splits past a short sequence's last piece are empty; the result is the single pass's."""
    monkeypatch.setattr(decode_attention, "LONG_SPLIT_TOKENS", 64)
    query, _, _, kv_cache, meta = make_batch([1] * 3, [40, 150, 300], 4, 1, 64, torch.float32)
    args = (query, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    single = paged_decode_attention(*args, num_splits=1)
    # 3 programs of 8 SMs' worth: as many splits as the longest sequence has pieces of 64
    split = choose_decode_split(3, 1, 300, sms=2)
    assert split == DecodeSplit(4, 64)
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 2)
    assert relative_error(paged_decode_attention(*args, max_seq_len=300), single) < 1e-6


def test_decode_split_k_agrees_with_single_pass() -> None:
    query, _, _, kv_cache, meta = make_batch([1, 1], [90, 200], 4, 1, 64, torch.float32)
    args = (query, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    single = paged_decode_attention(*args, num_splits=1)
    # more splits than tiles: the empty splits must not disturb the merge
    for splits in (2, 7):
        assert relative_error(paged_decode_attention(*args, num_splits=splits), single) < 1e-6


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_rows_past_the_batch_are_zero(num_splits: int) -> None:
    query, _, _, kv_cache, meta = make_batch([1, 1], [5, 40], 4, 2, 64, torch.float32)
    padded = torch.cat([query, torch.randn_like(query[:1]).expand(3, -1, -1)])
    out = torch.full_like(padded, float("nan"))
    paged_decode_attention(
        padded, kv_cache, meta.block_tables, meta.seq_lens, 0.125, out=out, num_splits=num_splits
    )
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert relative_error(out[:2], reference_attention(query, kv_cache, meta, 0.125)) < 1e-5


PREFILL_CASES = [
    # (query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size)
    ([5, 70, 17], [5, 70, 17], 4, 1, 64, torch.float32, 16),  # fresh prompts
    ([1, 70, 3, 20], [40, 100, 3, 52], 8, 2, 128, torch.float32, 16),  # prefix hits, a decode row
    ([33, 1, 9], [60, 17, 9], 8, 1, 64, torch.float16, 32),
    ([1, 40, 1, 7], [50, 45, 9, 7], 6, 2, 32, torch.float32, 16),  # 3 query heads per KV head
]
if FULL:
    PREFILL_CASES = [
        (
            [1, 300, 129, 7, 1, 64],
            [900, 300, 1000, 7, 33, 64 + 16 * 40],
            heads * group,
            heads,
            head_dim,
            dtype,
            block_size,
        )
        for heads, group in [(2, 1), (2, 4), (1, 8), (8, 2), (2, 3)]
        for head_dim in (64, 128)
        for dtype in DTYPES
        for block_size in (16, 32)
    ]


@pytest.mark.parametrize("tiles", ["default", "short_query"])
@pytest.mark.parametrize(
    "query_lens,seq_lens,num_heads,num_kv_heads,head_dim,dtype,block_size", PREFILL_CASES
)
def test_prefill_matches_reference(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    tiles: str,
) -> None:
    query, _, _, kv_cache, meta = make_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size
    )
    scale = head_dim**-0.5
    configs = {"default": default_prefill_config, "short_query": short_query_prefill_config}
    out = paged_prefill_attention(
        query,
        kv_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        meta.max_query_len,
        config=configs[tiles](dtype),
    )
    assert relative_error(out, reference_attention(query, kv_cache, meta, scale)) < TOLERANCE[dtype]


def test_prefill_writes_every_row_of_a_long_prompt() -> None:
    query, _, _, kv_cache, meta = make_batch([150], [150], 2, 2, 64, torch.float32)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(
        query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125, 150, out=out
    )
    assert not out.isnan().any()
    assert relative_error(out, reference_attention(query, kv_cache, meta, 0.125)) < 1e-5


@pytest.mark.parametrize("tiles", [default_prefill_config, short_query_prefill_config])
def test_prefill_skips_zero_length_requests(tiles) -> None:
    """Request slots padded as zero-length requests (the token count repeated in
    query_start_loc, seq_len 0), as a graph captured for more requests than a step has
    passes them: they write nothing and the real requests' rows are exact."""
    query_lens, seq_lens = [3, 70, 1], [10, 90, 12]
    query, _, _, kv_cache, meta = make_batch(
        query_lens, seq_lens, 4, 2, 32, torch.float32, padding_tokens=5
    )
    padded, total = 6, sum(query_lens)

    def pad(tensor: torch.Tensor, value: int) -> torch.Tensor:
        rows = tensor.new_full((padded, *tensor.shape[1:]), value)
        return torch.cat([tensor, rows])

    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(
        query, kv_cache, pad(meta.query_start_loc, total), pad(meta.seq_lens, 0),
        pad(meta.block_tables, 0), 0.125, 70, out=out, config=tiles(torch.float32),
    )  # fmt: skip
    assert out[total:].isnan().all()
    ref = reference_attention(query, kv_cache, meta, 0.125)
    assert relative_error(out[:total], ref[:total]) < 1e-5


@pytest.mark.parametrize("num_decodes", [2, 100])
def test_prefill_starts_at_the_first_request_of_a_slice(num_decodes: int) -> None:
    """Given the metadata of the requests after num_decodes decodes (as a mixed step passes its
    prompts, the decodes at the front going to the decode kernel), rows before them are left
    alone: 100 decode rows span several of the kernel's tiles, which own no request."""
    query_lens = [1] * num_decodes + [70, 1, 9]
    seq_lens = [40 + i % 7 for i in range(num_decodes)] + [90, 12, 9]
    query, _, _, kv_cache, meta = make_batch(query_lens, seq_lens, 4, 2, 32, torch.float32)
    out = torch.full_like(query, float("nan"))
    d = num_decodes
    paged_prefill_attention(
        query, kv_cache, meta.query_start_loc[d:], meta.seq_lens[d:], meta.block_tables[d:],
        0.125, 70, out=out,
    )  # fmt: skip
    assert out[:d].isnan().all()
    ref = reference_attention(query, kv_cache, meta, 0.125)
    assert relative_error(out[d:], ref[d:]) < 1e-5


def write_and_attend(backend, query, key, value, kv_cache, meta, scale) -> torch.Tensor:
    """What a layer does after its own q/k preparation: the KV write, then attention."""
    write = reshape_and_cache if isinstance(backend, TritonAttentionBackend) else write_kv_cache
    write(key, value, kv_cache, meta.slot_mapping)
    return backend.attend(query, kv_cache, meta, scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_matches_torch_backend_on_mixed_batch(dtype: torch.dtype) -> None:
    query_lens, seq_lens = [1, 24, 1, 6], [33, 24, 2, 70]
    query, key, value, kv_cache, meta = make_batch(
        query_lens, seq_lens, 8, 2, 64, dtype, padding_tokens=2
    )
    ref_cache = kv_cache.float().clone()
    out = write_and_attend(TritonAttentionBackend(), query, key, value, kv_cache, meta, 0.125)
    ref = write_and_attend(
        TorchAttentionBackend(), query.float(), key.float(), value.float(), ref_cache, meta, 0.125
    )
    assert torch.equal(kv_cache.float(), ref_cache)
    n = sum(query_lens)
    assert relative_error(out[:n], ref[:n]) < TOLERANCE[dtype]


@pytest.mark.parametrize("max_short_step_tokens", [0, 768])
@pytest.mark.parametrize("min_split_decodes", [1, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_on_decodes_around_prompt_chunks_with_padding_tokens(
    dtype: torch.dtype, min_split_decodes: int, max_short_step_tokens: int
) -> None:
    """A mixed step as the piecewise graphs run it: decode rows before and after prompt chunks,
    and padding tokens past the last request (their rows are never read); the leading decodes
    in the decode kernel (1) or in the prefill kernel with the rest (64), in 128-row tiles (0)
    or 16-row ones (768)."""
    query_lens, seq_lens = [1, 1, 1, 17, 1, 5], [40, 1, 129, 17, 70, 33]
    query, key, value, kv_cache, meta = make_batch(
        query_lens, seq_lens, 8, 2, 64, dtype, padding_tokens=3
    )
    ref_cache = kv_cache.float().clone()
    backend = TritonAttentionBackend(min_split_decodes, max_short_step_tokens)
    out = write_and_attend(backend, query, key, value, kv_cache, meta, 0.125)
    ref = write_and_attend(
        TorchAttentionBackend(), query.float(), key.float(), value.float(), ref_cache, meta, 0.125
    )
    n = sum(query_lens)
    assert relative_error(out[:n], ref[:n]) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    "backend", [TorchAttentionBackend(), TritonAttentionBackend(), TritonAttentionBackend(1)]
)
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 9, 1, 4]])
def test_backends_write_into_a_given_output(backend, query_lens: list[int]) -> None:
    seq_lens = [20, 9, 37, 4][: len(query_lens)]
    query, key, value, kv_cache, meta = make_batch(
        query_lens, seq_lens, 4, 2, 32, torch.float32, padding_tokens=2
    )
    write = reshape_and_cache if isinstance(backend, TritonAttentionBackend) else write_kv_cache
    write(key, value, kv_cache, meta.slot_mapping)
    fresh = backend.attend(query, kv_cache, meta, 0.125)
    out = torch.zeros_like(query)
    assert backend.attend(query, kv_cache, meta, 0.125, out) is out
    n = sum(query_lens)
    assert torch.equal(out[:n], fresh[:n])


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_decode_matches_torch_backend(dtype: torch.dtype) -> None:
    seq_lens = [1, 16, 17, 64, 100]
    query, key, value, kv_cache, meta = make_batch([1] * 5, seq_lens, 8, 4, 64, dtype)
    ref_cache = kv_cache.float().clone()
    out = write_and_attend(TritonAttentionBackend(), query, key, value, kv_cache, meta, 0.125)
    ref = write_and_attend(
        TorchAttentionBackend(), query.float(), key.float(), value.float(), ref_cache, meta, 0.125
    )
    assert torch.equal(kv_cache.float(), ref_cache)
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_torch_decode_groups_by_length_match_reference() -> None:
    """Unsorted lengths over several groups; two layers share the step's groups, and a new
    step (new metadata) makes new ones."""
    backend = TorchAttentionBackend(use_cpu_kernel=False)  # the grouped fallback
    for seq_lens in ([70, 3, 129, 17, 1, 64, 33, 250, 16, 2, 100], [5, 300, 40]):
        query, _, _, kv_cache, meta = make_batch(
            [1] * len(seq_lens), seq_lens, 6, 2, 32, torch.float32
        )
        for layer_cache in (kv_cache, torch.randn_like(kv_cache)):
            out = backend.attend(query, layer_cache, meta, 0.2)
            ref = reference_attention(query, layer_cache, meta, 0.2)
            assert relative_error(out, ref) < 1e-6


@NEEDS_CUDA
def test_backend_decode_replays_in_a_cuda_graph_as_sequences_grow() -> None:
    grown = [25, 320, 37, 1020]
    short = [s - 20 for s in grown]
    query, key, value, kv_cache, meta = make_batch([1] * 4, grown, 16, 8, 128, torch.bfloat16)
    table = meta.block_tables.cpu()

    def last_slots(lens: list[int]) -> torch.Tensor:
        slots = [int(table[r, (s - 1) // 16]) * 16 + (s - 1) % 16 for r, s in enumerate(lens)]
        return torch.tensor(slots, device=DEVICE)

    # captured with the short lengths (4 KV splits), replayed after every sequence grew
    static = AttentionMetadata(
        meta.query_start_loc,
        torch.tensor(short, dtype=torch.int32, device=DEVICE),
        meta.block_tables,
        last_slots(short),
        1,
        max(short),
        [1] * 4,
        short,
    )
    backend = TritonAttentionBackend()
    write_and_attend(backend, query, key, value, kv_cache, static, 0.088)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = write_and_attend(backend, query, key, value, kv_cache, static, 0.088)
    static.seq_lens.copy_(meta.seq_lens)
    static.slot_mapping.copy_(meta.slot_mapping)
    for t in (query, key, value):
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_attention(query, kv_cache, meta, 0.088)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
