"""The C++ CPU prompt-attention kernel against causal attention in float64 over the gathered KV,
and the torch backend with the kernel against the same backend on its torch paths alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cpu_decode_attention import NUM_KV_HEADS, paged_cache, step

from asyncllm.attention.torch_backend import TorchAttentionBackend, gather_kv
from kernels.cpu_decode_attention import (
    cpu_decode_attention_available,
    paged_prefill_attention_cpu,
)

BLOCK_SIZE = 16


@pytest.fixture(scope="module", autouse=True)
def built_kernel() -> None:
    assert cpu_decode_attention_available()


def causal_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Each request's KV gathered, then attention in float64 with an explicit causal mask."""
    rows, start = [], 0
    for r, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        k, v = (t.double().transpose(0, 1) for t in gather_kv(kv_cache, tables[r], seq_len))
        group = query.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        q = query[start : start + query_len].double().transpose(0, 1)
        positions = torch.arange(seq_len - query_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= positions
        rows.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))
        start += query_len
    return torch.cat([o.transpose(0, 1) for o in rows])


def kernel_out(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    starts = [sum(query_lens[:r]) for r in range(len(query_lens))]
    return paged_prefill_attention_cpu(
        query,
        kv_cache,
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(query_lens, dtype=torch.int32),
        scale,
        torch.full_like(query, float("nan")),
    )


# (query lengths, context lengths): the last query_len positions of each context are the query's
STEPS = [
    ([1], [1]),
    ([7], [7]),
    ([17], [17]),
    ([300], [300]),
    ([20], [57]),  # a chunked prompt or prefix-cache hit: 37 positions computed before
    ([1, 7, 17, 300, 20, 33], [1, 7, 17, 300, 57, 40]),
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("query_lens, seq_lens", STEPS)
def test_kernel_matches_causal_attention(
    query_lens: list[int],
    seq_lens: list[int],
    head_dim: int,
    group: int,
    cache_dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim + group)
    kv_cache, tables = paged_cache(seq_lens, BLOCK_SIZE, head_dim, cache_dtype, gen)
    query = torch.randn(sum(query_lens), group * NUM_KV_HEADS, head_dim, generator=gen)
    out = kernel_out(query, kv_cache, tables, query_lens, seq_lens, 0.3)
    ref = causal_reference(query, kv_cache, tables, query_lens, seq_lens, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_causal_attention_split_over_threads(threads: int) -> None:
    gen = torch.Generator().manual_seed(threads)
    query_lens, seq_lens = [250, 9, 40, 1, 130], [250, 9, 90, 5, 130]
    kv_cache, tables = paged_cache(seq_lens, BLOCK_SIZE, 64, torch.float32, gen)
    query = torch.randn(sum(query_lens), 3 * NUM_KV_HEADS, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel_out(query, kv_cache, tables, query_lens, seq_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    ref = causal_reference(query, kv_cache, tables, query_lens, seq_lens, 0.125)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_kernel_matches_causal_attention_with_peaked_scores() -> None:
    """Scores spread over hundreds: most weights underflow, and the running max moves often.
    A float32 score of hundreds is rounded by about 1e-5, and so its weight: elementwise, SDPA in
    float32 is as far from the float64 reference (5e-5) as the kernel, so the error is measured
    over the whole output."""
    gen = torch.Generator().manual_seed(2)
    query_lens, seq_lens = [61, 200], [61, 230]
    kv_cache, tables = paged_cache(seq_lens, BLOCK_SIZE, 64, torch.float32, gen)
    kv_cache[0] *= torch.linspace(0.5, 4, kv_cache.shape[1])[:, None, None, None]
    query = torch.randn(sum(query_lens), 2 * NUM_KV_HEADS, 64, generator=gen)
    out = kernel_out(query, kv_cache, tables, query_lens, seq_lens, 4.0)
    ref = causal_reference(query, kv_cache, tables, query_lens, seq_lens, 4.0)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_kernel_leaves_rows_of_no_request_alone() -> None:
    """Two requests whose rows lie apart, a padding row past them."""
    gen = torch.Generator().manual_seed(0)
    kv_cache, tables = paged_cache([20, 30], BLOCK_SIZE, 64, torch.float32, gen)
    query = torch.randn(56, 4, 64, generator=gen)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention_cpu(
        query,
        kv_cache,
        tables,
        torch.tensor([20, 30], dtype=torch.int32),
        torch.tensor([0, 25], dtype=torch.int32),
        torch.tensor([20, 30], dtype=torch.int32),
        0.125,
        out,
    )
    written = torch.zeros(56, dtype=torch.bool)
    written[:20] = written[25:55] = True
    assert not out[written].isnan().any() and out[~written].isnan().all()


def test_kernel_rejects_a_query_longer_than_its_context() -> None:
    gen = torch.Generator().manual_seed(0)
    kv_cache, tables = paged_cache([7], BLOCK_SIZE, 64, torch.float32, gen)
    query = torch.randn(8, 2, 64, generator=gen)
    with pytest.raises(RuntimeError, match="query_lens"):
        kernel_out(query, kv_cache, tables, [8], [7], 0.125)


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([40], [40]),  # a prompt alone
        ([1, 17, 1, 130, 5], [40, 17, 1, 170, 33]),  # decodes and drafts around prompt chunks
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_backend_with_kernel_matches_its_torch_paths(
    query_lens: list[int], seq_lens: list[int], cache_dtype: torch.dtype
) -> None:
    """The query a view of the fused qkv rows, as prepare_qkv leaves it, and a padding row."""
    gen = torch.Generator().manual_seed(1)
    kv_cache, tables = paged_cache(seq_lens, BLOCK_SIZE, 64, cache_dtype, gen)
    meta = step(query_lens, seq_lens, tables)
    heads = [6, NUM_KV_HEADS, NUM_KV_HEADS]
    qkv = torch.randn(sum(query_lens) + 1, sum(heads), 64, generator=gen)
    query = qkv.split(heads, dim=1)[0]
    out = TorchAttentionBackend().attend(query, kv_cache, meta, 0.125)
    ref = TorchAttentionBackend(use_cpu_kernel=False).attend(query, kv_cache, meta, 0.125)
    n = sum(query_lens)
    torch.testing.assert_close(out[:n], ref[:n], rtol=1e-5, atol=1e-5)
