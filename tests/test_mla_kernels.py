"""The paged MLA decode kernel and the latent cache write against the torch reference.

On CPU under TRITON_INTERPRET=1 (conftest.py) at tiny sizes; with a GPU in bf16 too, at
DeepSeek-V2-Lite's widths."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_vs_hf import metadata

import kernels
from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.mla import (
    MLADims,
    MLAttention,
    _row_contexts,
    attend_latent_torch,
    mixed_plan,
    norm_rope_and_cache,
    row_contexts,
    up_projections,
    write_latent_cache,
)
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding
from kernels.mla_decode import (
    CONFIG_TABLE,
    MLADecodeConfig,
    choose_mla_splits,
    merge_mla_splits,
    mla_decode_config,
    paged_mla_decode,
)

FULL = torch.cuda.is_available()
DEVICE = "cuda" if FULL else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if FULL else [torch.float32]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (heads, kv_lora_rank, rope): heads below the 16-row tile, rank and rope not powers of two
DIMS = (16, 512, 64) if FULL else (5, 40, 12)
BLOCK_SIZE = 4
NUM_BLOCKS = 64
# None: the table's; tiles of fewer tokens than a block and of many blocks, a row's heads in two
# programs (3 and 2 of 5 here), the merge folded into the split launch, L2 prefetches (on a GPU)
CONFIGS = [
    None,
    MLADecodeConfig(16, 4, 2, 1),
    MLADecodeConfig(64, 8, 2, 2),
    MLADecodeConfig(16, 4, 2, 1, head_groups=2),
    MLADecodeConfig(16, 4, 2, 1, fold_merge=True),
    MLADecodeConfig(32, 4, 2, 2, head_groups=2, fold_merge=True),
    MLADecodeConfig(16, 4, 2, 1, prefetch_tokens=32),
]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def latent_cache(dtype: torch.dtype) -> torch.Tensor:
    _, rank, rope = DIMS
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shape = (1, NUM_BLOCKS, BLOCK_SIZE, 1, rank + rope)
    return torch.randn(shape, generator=gen, device=DEVICE).to(dtype)


# num_splits None: chosen from the shapes; 64 and 128: more splits than the contexts have tiles
# (128: the merge takes the rank in two chunks)
@pytest.mark.parametrize(
    ("config", "num_splits"),
    [(config, splits) for config in CONFIGS for splits in (1, 3, None)]
    + [(CONFIGS[1], 64), (CONFIGS[2], 128)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_matches_torch(
    dtype: torch.dtype, config: MLADecodeConfig | None, num_splits: int | None
) -> None:
    heads, rank, rope = DIMS
    if FULL and dtype == torch.float32 and config is not None:
        pytest.skip("on a GPU fp32 runs the table's fp32 config; the interpreter checks all")
    # one position, a part block, more than two 16-token tiles and a 64-token one, a padding row
    lengths = [1, 3, 77, 0, 21]
    tables = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))
    tables = tables[:60].view(3, 20).to(torch.int32).to(DEVICE)
    request = torch.tensor([0, 1, 2, 2, 1], dtype=torch.int32, device=DEVICE)
    length = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(lengths), heads, rank + rope, device=DEVICE).to(dtype)
    cache = latent_cache(dtype)
    scale = (rank + rope) ** -0.5
    out = paged_mla_decode(query, cache, tables, request, length, scale, rank, num_splits, config)
    ref = attend_latent_torch(query, cache, tables, request, length, scale, rank)
    assert out.shape == (len(lengths), heads, rank)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert relative_error(out, ref) < TOLERANCE[dtype]


# the merge launched or folded, heads whole or in two programs; 64 splits leave most empty
@pytest.mark.parametrize(
    "config",
    [
        MLADecodeConfig(16, 4, 2, 1),
        MLADecodeConfig(16, 4, 2, 1, fold_merge=True),
        MLADecodeConfig(32, 4, 2, 1, head_groups=2, fold_merge=True, prefetch_tokens=64),
    ],
)
@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_mla_decode_at_block_and_tile_edges(config: MLADecodeConfig, num_splits: int) -> None:
    heads, rank, rope = DIMS
    tile, capacity = config.tile_n, 20 * BLOCK_SIZE
    # one position, a block +-1, a tile +-1, the whole table, no context, in one batch
    edges = [BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, tile - 1, tile, tile + 1]
    lengths = [1, *edges, capacity - 1, capacity, 0]
    tables = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(2))
    tables = tables[:60].view(3, 20).to(torch.int32).to(DEVICE)
    request = (torch.arange(len(lengths), dtype=torch.int32) % 3).to(DEVICE)
    length = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    dtype = torch.bfloat16 if FULL else torch.float32
    query = torch.randn(len(lengths), heads, rank + rope, device=DEVICE).to(dtype)
    cache = latent_cache(dtype)
    scale = (rank + rope) ** -0.5
    counters = torch.zeros(len(lengths) * heads, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # a folded merge leaves its counters zero for the next call
        out = paged_mla_decode(
            query, cache, tables, request, length, scale, rank, num_splits, config, counters
        )
        assert not counters.any()
    ref = attend_latent_torch(query, cache, tables, request, length, scale, rank)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    for row, n in enumerate(lengths[:-1]):
        assert relative_error(out[row], ref[row]) < TOLERANCE[dtype], f"length {n}"


def test_merge_ignores_what_empty_splits_left() -> None:
    heads, rank, _ = DIMS
    # 40 positions in 4 splits of whole 16-token tiles: splits 0-2 hold them, 3 is empty; the
    # second row has no context, so all its splits are
    length = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    part_out = torch.randn(2, heads, 4, rank, device=DEVICE)
    part_lse = torch.randn(2, heads, 4, device=DEVICE)
    part_out[0, :, 3], part_lse[0, :, 3] = float("nan"), float("nan")
    part_out[1], part_lse[1] = float("nan"), float("nan")
    out = torch.empty(2, heads, rank, device=DEVICE)
    merge_mla_splits(part_out, part_lse, length, out, 16)
    weight = torch.exp2(part_lse[0, :, :3] - part_lse[0, :, :3].amax(-1, keepdim=True))
    expected = (part_out[0, :, :3] * weight[..., None]).sum(1) / weight.sum(-1)[:, None]
    torch.testing.assert_close(out[0], expected)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_latent_cache_write_skips_padding() -> None:
    width = sum(DIMS[1:])
    latent = torch.randn(4, width, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 17], device=DEVICE)
    ours, ref = latent_cache(torch.float32), latent_cache(torch.float32).cpu()
    kernels.write_latent_cache(latent, ours, slots)
    write_latent_cache(latent.cpu(), ref, slots.cpu())  # the torch path
    assert torch.equal(ours.cpu(), ref)
    assert torch.equal(ref[0].view(-1, width)[[5, 0, 17]], latent.cpu()[[0, 2, 3]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prep_kernel_matches_rope_norm_and_write_in_torch(dtype: torch.dtype) -> None:
    """One launch for the query's rope parts (in place), the latent's norm and rope key and the
    cache write, against the torch path the CPU runs; a padding token still rotates its query."""
    heads, rank, rope = DIMS
    nope, num_tokens = 7, 6
    gen = torch.Generator(device=DEVICE).manual_seed(8)
    query = torch.randn(num_tokens, heads, nope + rope, generator=gen, device=DEVICE).to(dtype)
    latent = torch.randn(num_tokens, rank + rope, generator=gen, device=DEVICE).to(dtype)
    positions = torch.tensor([0, 5, 63, 1, 17, 40], device=DEVICE)
    slots = torch.tensor([9, 0, -1, 200, 33, 4], device=DEVICE)
    rotary = RotaryEmbedding(rope, 64, 1e4, None, interleaved=True).to(DEVICE)
    norm = RMSNorm(rank, 1e-6).to(DEVICE)
    torch.nn.init.normal_(norm.weight, generator=gen)
    norm.to(dtype)
    ours_query, ref_query = query.clone(), query.clone().cpu()
    ours_cache, ref_cache = latent_cache(dtype), latent_cache(dtype).cpu()
    kernels.mla_norm_rope_and_cache(
        ours_query, latent, positions, rotary.cos_sin_cache, norm.weight, 1e-6, ours_cache, slots
    )
    norm_rope_and_cache(  # the torch path
        ref_query,
        latent.cpu(),
        positions.cpu(),
        rotary.cpu(),
        norm.cpu(),
        ref_cache,
        slots.cpu(),
    )
    assert relative_error(ours_query.cpu(), ref_query) < TOLERANCE[dtype]
    assert torch.equal(ours_query[..., :nope].cpu(), query[..., :nope].cpu())
    written = slots[slots >= 0].cpu()
    ours_rows, ref_rows = (
        ours_cache.cpu()[0].view(-1, rank + rope),
        ref_cache[0].view(-1, rank + rope),
    )
    assert relative_error(ours_rows[written], ref_rows[written]) < TOLERANCE[dtype]
    assert relative_error(ours_rows[written, rank:], ref_rows[written, rank:]) < TOLERANCE[dtype]
    ours_rows[written] = ref_rows[written]
    assert torch.equal(ours_rows, ref_rows)  # no other slot written


def test_row_contexts_are_causal_per_request() -> None:
    meta = metadata([(4, 3), (9, 1)], [[0, 1], [2, 3, 4]])
    request, length = row_contexts(meta, 6)  # two padding rows past the 4 real ones
    assert request.tolist()[:4] == [0, 0, 0, 1]
    assert length.tolist() == [5, 6, 7, 10, 0, 0]


def test_row_contexts_run_once_a_step() -> None:
    meta = metadata([(4, 3), (9, 1)], [[0, 1], [2, 3, 4]])
    first = row_contexts(meta, 4)
    assert row_contexts(meta, 4) is first  # the next layer's call launches nothing
    assert row_contexts(meta, 6) is not first


def test_pure_decode_rows_are_their_requests_last_positions() -> None:
    meta = metadata([(4, 1), (0, 1), (9, 1)], [[0, 1], [2], [3, 4, 5]])
    request, length = _row_contexts(meta, 3)
    assert request.tolist() == [0, 1, 2] and length.tolist() == [5, 1, 10]
    meta.max_query_len = 2  # the same rows through the general path
    general = _row_contexts(meta, 3)
    assert general[0].tolist() == [0, 1, 2] and general[1].tolist() == [5, 1, 10]


# decodes before, between and after two prompt chunks (one behind a cached context, both across
# blocks) and a request of no rows
MIXED_SPANS = [(5, 1), (0, 9), (3, 1), (0, 0), (6, 7), (2, 1)]


def mixed_metadata() -> tuple[list[list[int]], AttentionMetadata]:
    tables, first = [], 0
    for computed, new in MIXED_SPANS:
        count = max(1, -(-(computed + new) // BLOCK_SIZE))
        tables.append(list(range(first + count - 1, first - 1, -1)))  # blocks out of order
        first += count
    meta = metadata(MIXED_SPANS, tables)
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.init}
    moved = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    return tables, type(meta)(**moved)


def test_mixed_plan_splits_rows_and_lists_the_prompts_contexts() -> None:
    tables, meta = mixed_metadata()
    plan = mixed_plan(meta, 22, BLOCK_SIZE)  # 19 rows and 3 of padding
    assert plan.prompt_rows.tolist() == [*range(1, 10), *range(11, 18)]
    assert plan.decode_rows.tolist() == [0, 10, 18]
    assert plan.cu_q.tolist() == plan.cu_q_host == [0, 9, 16]
    assert plan.cu_k.tolist() == plan.cu_k_host == [0, 9, 22]
    slots = [
        t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for t, n in ((tables[1], 9), (tables[4], 13))
        for p in range(n)
    ]
    assert plan.context_slots.tolist() == slots


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_mixed_step_equals_absorbed_attention_row_for_row(dtype: torch.dtype) -> None:
    """The prompt chunks through their expanded keys and values (one flash call in bf16 on a
    GPU), the decodes absorbed: each row as the latent-space reference computes it."""
    heads, rank, rope = DIMS
    nope, width = (128, 128) if FULL else (6, 7)
    dims = MLADims(heads, nope, rope, width, rank, scale=(nope + rope) ** -0.5)
    _, meta = mixed_metadata()
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    query = torch.randn(22, heads, nope + rope, generator=gen, device=DEVICE).to(dtype)
    kv_b = torch.randn(heads * (nope + width), rank, generator=gen, device=DEVICE) / rank**0.5
    cache = latent_cache(dtype)
    out = MLAttention(dims).attend(query, cache, meta, kv_b.to(dtype))

    request, length = row_contexts(meta, 22)
    w_uk, w_uv = (w.double() for w in up_projections(kv_b, dims))
    q_nope, q_pe = query.double().split([nope, rope], dim=-1)
    absorbed = torch.cat([torch.einsum("thd,hdl->thl", q_nope, w_uk), q_pe], dim=-1)
    latent = attend_latent_torch(
        absorbed, cache.double(), meta.block_tables, request, length, dims.scale, rank
    )
    ref = torch.einsum("thl,hdl->thd", latent, w_uv)
    assert relative_error(out[:19], ref[:19]) < TOLERANCE[dtype]
    assert not out[19:].any()  # padding rows
    given = torch.full_like(out, float("nan"))  # a buffer of the caller's, written in place
    assert MLAttention(dims).attend(query, cache, meta, kv_b.to(dtype), given) is given
    assert torch.equal(given, out)


@pytest.mark.skipif(not FULL, reason="the counters are the CUDA kernel's")
@torch.inference_mode()
def test_a_steps_layers_share_fold_counters_left_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's call gets the step's one zeroed buffer (a fold leaves it zero, so the
    zeroing launches once a step), big enough for every row's heads."""
    heads, rank, rope = DIMS
    dims = MLADims(heads, 128, rope, 128, rank, scale=0.1)
    _, meta = mixed_metadata()
    given = []

    def recording(*args, counters=None):
        given.append(counters)
        return paged_mla_decode(*args, counters=counters)

    monkeypatch.setattr(kernels, "paged_mla_decode", recording)
    query = torch.randn(22, heads, 128 + rope, device=DEVICE, dtype=torch.bfloat16)
    kv_b = torch.randn(heads * 256, rank, device=DEVICE, dtype=torch.bfloat16) / rank**0.5
    layer = MLAttention(dims, max_absorbed_rows=64)  # every row absorbed
    first = layer.attend(query, latent_cache(torch.bfloat16), meta, kv_b)
    second = layer.attend(query, latent_cache(torch.bfloat16), meta, kv_b)
    assert len(given) == 2 and given[0] is given[1]
    assert given[0].numel() >= 22 * heads and not given[0].any()
    assert torch.equal(first, second)


def test_splits_fill_the_gpu_without_a_partial_wave() -> None:
    cpu = torch.device("cpu")  # 8 "SMs" here
    one, two = MLADecodeConfig(32, 4, 2, 1), MLADecodeConfig(64, 4, 2, 2)
    assert choose_mla_splits(1, 1, 4096, one, cpu) == 8  # a program per SM
    assert choose_mla_splits(1, 1, 4096, two, cpu) == 16
    assert choose_mla_splits(3, 1, 4096, one, cpu) == 2  # 6 programs, not 9
    assert choose_mla_splits(1, 1, 64, one, cpu) == 2  # no split shorter than a tile
    assert choose_mla_splits(8, 1, 4096, one, cpu) == 1  # a program per SM already
    assert choose_mla_splits(16, 2, 4096, two, cpu) == 1


def test_config_table_covers_every_batch() -> None:
    sizes = [e[0] for e in CONFIG_TABLE]
    assert sizes == sorted(sizes)
    assert mla_decode_config(1, torch.bfloat16) == MLADecodeConfig(*CONFIG_TABLE[0][1:])
    assert mla_decode_config(sizes[0] + 1, torch.bfloat16) == MLADecodeConfig(*CONFIG_TABLE[1][1:])
    assert mla_decode_config(10**6, torch.bfloat16) == MLADecodeConfig(*CONFIG_TABLE[-1][1:])
    assert mla_decode_config(1, torch.float32).tile_n == 16
