"""The C++ CPU decode-attention kernel against torch SDPA over gathered KV, and the torch backend
with the kernel against the same backend on its torch paths alone."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.torch_backend import TorchAttentionBackend, gather_kv
from kernels.cpu_decode_attention import cpu_decode_attention_available, paged_decode_attention_cpu

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
NUM_KV_HEADS = 2


@pytest.fixture(scope="module", autouse=True)
def built_kernel() -> None:
    assert cpu_decode_attention_available()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def paged_cache(
    seq_lens: list[int], block_size: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache and block tables of shuffled block ids, padded with spare columns."""
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    ids = torch.randperm(sum(blocks) + 3, generator=gen).int()
    tables = torch.zeros(len(seq_lens), max(blocks) + 2, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = ids[start : start + n]
        start += n
    shape = (2, len(ids), block_size, NUM_KV_HEADS, head_dim)
    return torch.randn(*shape, generator=gen).to(dtype), tables


def sdpa_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, seq_lens: list[int], scale
) -> torch.Tensor:
    """Each request's KV gathered, then SDPA in float32 (the torch backend's way)."""
    rows = []
    for r, seq_len in enumerate(seq_lens):
        k, v = (t.float().transpose(0, 1) for t in gather_kv(kv_cache, tables[r], seq_len))
        group = query.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        q = query[r].float()[:, None]
        rows.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])
    return torch.stack(rows)


# (query and output, cache): float32 over a bf16 cache is `--dtype bfloat16` on CPU
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("dtype, cache_dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("group", [1, 3, 4, 8])  # the kernel takes query heads 3 at a time
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: the kernel's generic head_dim
def test_kernel_matches_sdpa_over_gathered_kv(
    head_dim: int, group: int, block_size: int, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(head_dim + group + block_size)
    randoms = torch.randint(2, 300, (5,), generator=gen).tolist()
    seq_lens = [1, block_size, block_size + 1, 2 * block_size, *randoms]
    kv_cache, tables = paged_cache(seq_lens, block_size, head_dim, cache_dtype, gen)
    query = torch.randn(len(seq_lens), group * NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention_cpu(query, kv_cache, tables, lens, 0.3, torch.empty_like(query))
    ref = sdpa_reference(query, kv_cache, tables, seq_lens, 0.3)
    assert relative_error(out, ref) < TOLERANCE[dtype]


def kernel_error(
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: list[int],
    group: int,
    scale: float,
    gen: torch.Generator,
) -> float:
    """The kernel's fp32 relative error against SDPA for a random query."""
    query = torch.randn(len(seq_lens), group * NUM_KV_HEADS, kv_cache.shape[-1], generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention_cpu(query, kv_cache, tables, lens, scale, torch.empty_like(query))
    return relative_error(out, sdpa_reference(query, kv_cache, tables, seq_lens, scale))


@pytest.mark.parametrize("seq_lens", [[1], [9, 300], [17, 8, 250]])
def test_kernel_matches_sdpa_for_few_requests(seq_lens: list[int]) -> None:
    """Fewer requests than four per thread: one KV head per work item."""
    gen = torch.Generator().manual_seed(len(seq_lens))
    kv_cache, tables = paged_cache(seq_lens, 16, 64, torch.float32, gen)
    assert kernel_error(kv_cache, tables, seq_lens, 3, 0.3, gen) < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_sdpa_with_contexts_split_over_threads(
    threads: int, cache_dtype: torch.dtype
) -> None:
    """Threads take parts of about equal tokens: one long context among short ones."""
    gen = torch.Generator().manual_seed(threads)
    seq_lens = [400, 1, 15, 16, 17, 2, 3, 250, 9, 33, 1, 5]
    kv_cache, tables = paged_cache(seq_lens, 16, 64, cache_dtype, gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        error = kernel_error(kv_cache, tables, seq_lens, 3, 0.3, gen)
    finally:
        torch.set_num_threads(before)
    assert error < 1e-5


def test_kernel_matches_sdpa_with_peaked_scores() -> None:
    """Scores spread over hundreds: most weights underflow, and the running max moves often."""
    gen = torch.Generator().manual_seed(2)
    seq_lens = [61, 200, 7]
    kv_cache, tables = paged_cache(seq_lens, 16, 64, torch.float32, gen)
    kv_cache[0] *= torch.linspace(0.5, 4, kv_cache.shape[1])[:, None, None, None]
    assert kernel_error(kv_cache, tables, seq_lens, 2, 4.0, gen) < 1e-5


def test_kernel_leaves_rows_past_the_requests_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    kv_cache, tables = paged_cache([7, 40], 16, 64, torch.float32, gen)
    query = torch.randn(4, 4, 64, generator=gen)
    out = torch.full_like(query, float("nan"))
    lens = torch.tensor([7, 40], dtype=torch.int32)
    paged_decode_attention_cpu(query, kv_cache, tables, lens, 0.125, out)
    assert not out[:2].isnan().any() and out[2:].isnan().all()


def test_kernel_rejects_a_context_longer_than_its_block_table() -> None:
    gen = torch.Generator().manual_seed(0)
    kv_cache, tables = paged_cache([7], 16, 64, torch.float32, gen)
    query = torch.randn(1, 2, 64, generator=gen)
    too_long = torch.tensor([tables.shape[1] * 16 + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="seq_lens"):
        paged_decode_attention_cpu(query, kv_cache, tables, too_long, 0.125, query.clone())


def test_kernel_rejects_a_head_dim_off_its_vectors() -> None:
    gen = torch.Generator().manual_seed(0)
    kv_cache, tables = paged_cache([7], 16, 12, torch.float32, gen)
    query = torch.randn(1, 2, 12, generator=gen)
    lens = torch.tensor([7], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        paged_decode_attention_cpu(query, kv_cache, tables, lens, 0.125, query.clone())


def step(query_lens: list[int], seq_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def test_backend_decodes_a_head_dim_off_the_kernels_vectors_on_torch() -> None:
    gen = torch.Generator().manual_seed(3)
    kv_cache, tables = paged_cache([30, 5], 16, 12, torch.float32, gen)
    meta = step([1, 1], [30, 5], tables)
    query = torch.randn(2, 4, 12, generator=gen)
    out = TorchAttentionBackend().attend(query, kv_cache, meta, 0.3)
    ref = sdpa_reference(query, kv_cache, tables, [30, 5], 0.3)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1] * 6, [70, 1, 129, 16, 33, 250]),  # pure decode
        ([1, 17, 1, 1, 5, 1], [40, 17, 1, 129, 33, 70]),  # decodes around prompt chunks
        ([5, 5, 1, 5], [5, 40, 9, 250]),  # verify steps: each query row a decode row
        ([16, 17, 2], [16, 80, 130]),  # the longest query the kernel takes, and one past it
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_backend_with_kernel_matches_its_torch_paths(
    query_lens: list[int], seq_lens: list[int], cache_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    kv_cache, tables = paged_cache(seq_lens, 16, 64, cache_dtype, gen)
    meta = step(query_lens, seq_lens, tables)
    query = torch.randn(sum(query_lens) + 2, 6, 64, generator=gen)  # two padding tokens
    out = TorchAttentionBackend().attend(query, kv_cache, meta, 0.125)
    ref = TorchAttentionBackend(use_cpu_kernel=False).attend(query, kv_cache, meta, 0.125)
    n = sum(query_lens)
    assert relative_error(out[:n], ref[:n]) < 1e-5


def test_backend_verify_step_reads_the_query_heads_in_place() -> None:
    """A verify step's query is a view of the fused qkv rows (prepare_qkv splits it): the
    kernel reads it in place, every row as the decode step at its position."""
    gen = torch.Generator().manual_seed(4)
    query_lens, seq_lens = [5, 3, 5], [9, 40, 130]
    kv_cache, tables = paged_cache(seq_lens, 16, 64, torch.float32, gen)
    meta = step(query_lens, seq_lens, tables)
    heads = [6, NUM_KV_HEADS, NUM_KV_HEADS]
    qkv = torch.randn(sum(query_lens) + 1, sum(heads), 64, generator=gen)  # a padding token
    query = qkv.split(heads, dim=1)[0]
    out = TorchAttentionBackend().attend(query, kv_cache, meta, 0.125)
    ref = TorchAttentionBackend(use_cpu_kernel=False).attend(query, kv_cache, meta, 0.125)
    n = sum(query_lens)
    assert not query.is_contiguous()
    assert relative_error(out[:n], ref[:n]) < 1e-5
