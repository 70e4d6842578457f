"""The fused MoE kernel against the torch experts on awkward routings.

On CPU under TRITON_INTERPRET=1 (conftest.py) at tiny sizes; with a GPU in bf16 too, at
model-sized widths."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from asyncllm.layers.fused_moe.torch_experts import torch_experts
from kernels.fused_moe import (
    ExpertAlignment,
    MoeTileConfig,
    MoeTiles,
    align_by_expert,
    default_tile_config,
    fused_experts,
    tiles_from_json,
    tiles_to_json,
    tma_fits,
    top_k_sum,
    uses_one_pair_tiles,
)
from kernels.moe_gemv import MoeGemvConfig, summed_down_gemv, up_gemv

FULL = torch.cuda.is_available()
DEVICE = "cuda" if FULL else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if FULL else [torch.float32]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (experts, hidden, inner): inner not a multiple of the tiles, hidden not a power of two
SHAPE = (8, 4096, 1792) if FULL else (5, 48, 40)
SMALL_TILES = MoeTileConfig(16, 16, 16, 2, 4, 1)
# each GEMM its own tiles: down's K (the inner size) not a multiple of its BLOCK_K on CPU
MIXED_TILES = MoeTiles(MoeTileConfig(16, 32, 16, 1, 4, 1), MoeTileConfig(16, 16, 32, 4, 4, 2))
# full tiles of 32 rows and the runs' rest in tiles of 16
TAILED_TILES = MoeTiles(MoeTileConfig(32, 16, 16, 2, 4, 1), MoeTileConfig(32, 32, 16, 1, 4, 1), 16)
# the weights through TMA descriptors, with tails; on CPU down's N (48) and K (40) are not
# multiples of its 32-wide tiles: rows past N discarded, columns past K zero-filled
TMA_TILES = MoeTiles(
    MoeTileConfig(32, 32, 16, 2, 4, 2, weight_tma=True),
    MoeTileConfig(32, 32, 32, 1, 4, 2, weight_tma=True),
    16,
)
# down over the sorted rows by a program per SM (8 under the interpreter), each walking tiles
PERSISTENT_TILES = MoeTiles(
    MoeTileConfig(16, 16, 16, 2, 4, 1),
    MoeTileConfig(16, 16, 16, 1, 4, 2, weight_tma=True, persistent=True),
)
# at one pair a tile gate/up as grouped GEMVs (the other routings ignore it)
GEMV_TILES = MoeTiles(SMALL_TILES, SMALL_TILES, up_gemv=True)
# at one pair a tile down as grouped GEMVs summing each token's choices, with gate/up's GEMM
DOWN_GEMV_TILES = MoeTiles(SMALL_TILES, SMALL_TILES, down_gemv=True)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def weights(dtype: torch.dtype, shape=SHAPE) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts, hidden, inner = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inner, hidden, generator=gen, device=DEVICE) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inner, generator=gen, device=DEVICE) / inner**0.5
    return w13.to(dtype), w2.to(dtype)


def routing(topk_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(topk_ids, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    weights = torch.rand(ids.shape, generator=gen, device=DEVICE) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


ROUTINGS = {
    # expert 4 gets no token, experts 0-3 one pair each
    "one_token_two_experts": [[0, 1]],
    "three_tokens_some_experts_idle": [[2, 0], [0, 2], [3, 1]],
    # expert 1 gets 19 pairs: more than one 16-row tile
    "one_expert_past_a_block": [[1, (t % 4) * (t % 2 == 0) + (t % 2 == 1) * 3] for t in range(19)],
    # expert 2 gets 41 pairs: a full 32-row tile and a tail; the others 10-11 each
    "one_expert_past_two_blocks": [[2, t % 4 if t % 4 != 2 else 4] for t in range(41)],
    "odd_batch_random": torch.stack(
        [torch.randperm(5, generator=torch.Generator().manual_seed(t))[:2] for t in range(37)]
    ).tolist(),
}


# every tiling in fp32 under the interpreter; on a GPU, where each one compiles, the tuned
# tables' bf16 with all but mixed (tailed and tma have tiles of their own per GEMM too) and
# fp32 with the default's
TILINGS = ["small", "mixed", "tailed", "tma", "persistent", "gemv", "down_gemv", "default"]
TILINGS_BY_DTYPE = [
    (tiles, dtype)
    for tiles in TILINGS
    for dtype in DTYPES
    if not FULL or (dtype == torch.bfloat16 and tiles != "mixed") or tiles == "default"
]


@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("tiles,dtype", TILINGS_BY_DTYPE)
def test_fused_experts_match_torch(name: str, tiles: str, dtype: torch.dtype) -> None:
    topk_weights, topk_ids = routing(ROUTINGS[name])
    w13, w2 = weights(dtype)
    x = torch.randn(topk_ids.shape[0], SHAPE[1], device=DEVICE).to(dtype)
    config = {
        "small": MoeTiles.same(SMALL_TILES),
        "mixed": MIXED_TILES,
        "tailed": TAILED_TILES,
        "tma": TMA_TILES,
        "persistent": PERSISTENT_TILES,
        "gemv": GEMV_TILES,
        "down_gemv": DOWN_GEMV_TILES,
        "default": MoeTiles.same(default_tile_config(x.shape[0])),
    }[tiles]
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, config)
    ref = torch_experts(x, w13, w2, topk_weights, topk_ids)
    assert out.shape == ref.shape and out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("inner", [SHAPE[2], SHAPE[2] - 2])
def test_down_reads_the_sorted_activations_through_tma_or_pointers(inner: int) -> None:
    """Gate/up writes each pair's activations at its sorted row, padding rows left unwritten;
    down reads a tile's rows whole through a TMA descriptor, or by pointers where the rows are
    not 16-byte aligned (inner - 2 fp32 or bf16 values)."""
    dtype = DTYPES[-1]
    assert tma_fits(torch.empty(2, inner, dtype=dtype)) == (inner == SHAPE[2])
    shape = (SHAPE[0], SHAPE[1], inner)
    w13, w2 = weights(dtype, shape)
    topk_weights, topk_ids = routing(ROUTINGS["one_expert_past_two_blocks"])
    x = torch.randn(topk_ids.shape[0], SHAPE[1], device=DEVICE).to(dtype)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, MoeTiles.same(SMALL_TILES))
    ref = torch_experts(x, w13, w2, topk_weights, topk_ids)
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_no_tokens_give_an_empty_output() -> None:
    w13, w2 = weights(torch.float32)
    x = torch.zeros(0, SHAPE[1], device=DEVICE)
    ids = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    assert fused_experts(x, w13, w2, ids.float(), ids).shape == (0, SHAPE[1])


def used_tiles(aligned) -> dict[int, list[tuple[int, int]]]:
    """Each list's tiles in use: height -> [(first row, expert), ...]."""
    return {
        tiles.height: list(zip(tiles.rows.tolist(), tiles.experts.tolist(), strict=True))[
            : int(tiles.count)
        ]
        for tiles in aligned.tiles
    }


def runs(aligned: ExpertAlignment, lengths: list[int]) -> list[list[int]]:
    """The sorted list cut into runs of these lengths, each run's pair ids in ascending order
    (the alignment leaves a run's order open; the padding sentinel sorts last)."""
    rows, start = aligned.sorted_pair_ids.tolist(), 0
    cut = []
    for length in lengths:
        cut.append(sorted(rows[start : start + length]))
        start += length
    return cut


def test_alignment_pads_each_expert_to_the_block() -> None:
    ids = torch.tensor([[2, 0], [0, 2], [3, 0]], dtype=torch.int32, device=DEVICE)
    aligned = align_by_expert(ids, block_m=4, num_experts=5)
    # experts 0, 2, 3: one 4-row tile each
    assert used_tiles(aligned) == {4: [(0, 0), (4, 2), (8, 3)]}
    # each run's pairs in any order, its padding (the sentinel 6) after them
    assert runs(aligned, [4, 4, 4]) == [[1, 2, 5, 6], [0, 3, 6, 6], [4, 6, 6, 6]]


def test_tails_take_tiles_of_their_own_height() -> None:
    # expert 0: 5 pairs (a full tile of 4 and a tail of 1), expert 1: 1 (a tail only),
    # expert 3: 4 (a full tile, no tail); expert 2 idle
    ids = torch.tensor([[0, 1]] + [[0, 3]] * 4, dtype=torch.int32, device=DEVICE)
    aligned = align_by_expert(ids, block_m=4, num_experts=4, tail_m=2)
    assert used_tiles(aligned) == {4: [(0, 0), (8, 3)], 2: [(4, 0), (6, 1)]}
    # expert 0's five pairs in its full tile and tail, padded after them
    assert runs(aligned, [6, 2, 4]) == [[0, 2, 4, 6, 8, 10], [1, 10], [3, 5, 7, 9]]
    assert aligned.sorted_pair_ids[5] == 10


def test_tile_config_takes_the_nearest_committed_batch_size(tmp_path, monkeypatch) -> None:
    import kernels.fused_moe as fused_moe

    decode = MoeTiles(SMALL_TILES, MoeTileConfig(16, 128, 64, 1, 4, 4))
    table = {"1": tiles_to_json(decode), "64": MoeTileConfig(32, 64, 64, 8, 4, 3).__dict__}
    name = fused_moe.config_file_name(8, 1792, 4096, "cpu")
    (tmp_path / name).write_text(json.dumps(table))
    monkeypatch.setattr(fused_moe, "CONFIG_DIR", tmp_path)
    fused_moe._config_table.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert fused_moe.tile_config(8, 1792, 4096, 3, cpu) == decode
        prefill = fused_moe.tile_config(8, 1792, 4096, 50, cpu)  # one entry for both GEMMs
        assert prefill.up == prefill.down and prefill.up.block_m == 32
        default = MoeTiles.same(default_tile_config(3))
        assert fused_moe.tile_config(8, 1024, 4096, 3, cpu) == default
    finally:
        fused_moe._config_table.cache_clear()


@pytest.mark.parametrize("tail_m", [0, 8])
@pytest.mark.parametrize("num_experts,num_tokens", [(5, 700), (200, 1100)])
def test_alignment_over_many_programs_groups_each_experts_pairs(
    num_experts, num_tokens, tail_m
) -> None:
    # 1,400 pairs of 5 experts: two programs of 1,024 pairs; of 200 experts, 2,200 pairs:
    # three, most experts' counts added to by each; experts left idle either way
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, num_experts - 2, (num_tokens, 2), generator=gen, dtype=torch.int32)
    aligned = align_by_expert(ids.to(DEVICE), 16, num_experts, tail_m)
    flat, expected, lengths, tiles = ids.flatten(), [], [], {16: [], tail_m: []}
    for e in range(num_experts):
        run = (flat == e).nonzero().flatten().tolist()
        full = len(run) // 16 if tail_m else -(-len(run) // 16)
        tiles[16] += [(sum(lengths) + 16 * i, e) for i in range(full)]
        height = tail_m or 16
        run += [flat.numel()] * (-len(run) % height)
        tail_start = sum(lengths) + 16 * full
        tiles[tail_m] += [
            (tail_start + height * i, e) for i in range((len(run) - 16 * full) // height)
        ]
        expected.append(run)
        lengths.append(len(run))
    assert used_tiles(aligned) == {h: t for h, t in tiles.items() if h}
    assert runs(aligned, lengths) == expected
    assert set(aligned.sorted_pair_ids.tolist()[sum(lengths) :]) <= {flat.numel()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_sum_adds_each_tokens_choices(dtype) -> None:
    # 6 choices (a power of two in the tile, 2 masked), 1,100 columns: a second, partial block
    rows = torch.randn(3, 6, 1100, device=DEVICE).to(dtype)
    expected = rows.double().sum(1)
    assert relative_error(top_k_sum(rows), expected) < TOLERANCE[dtype] / 10


def test_default_tiles_follow_each_experts_run_at_prefill() -> None:
    # 512 tokens, top-8 of 128 experts: 32 rows each; of 8 experts, top-2: 128; 8,192 of 8: 2,048
    assert default_tile_config(512, 32.0).block_m == 32
    assert default_tile_config(512, 128.0).block_m == 64
    assert default_tile_config(8192, 2048.0).block_m == 128
    assert default_tile_config(8).block_m == 16


@pytest.mark.parametrize(("up_gemv", "down_gemv"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("name", ["three_tokens_some_experts_idle", "odd_batch_random"])
def test_one_pair_tiles_match_torch_when_pairs_share_experts(
    name, up_gemv, down_gemv, monkeypatch
) -> None:
    import kernels.fused_moe as fused_moe

    monkeypatch.setattr(fused_moe, "uses_one_pair_tiles", lambda *_: True)
    topk_weights, topk_ids = routing(ROUTINGS[name])
    w13, w2 = weights(torch.float32)
    x = torch.randn(topk_ids.shape[0], SHAPE[1], device=DEVICE)
    config = default_tile_config(1)
    tiles = MoeTiles(config, config, up_gemv=up_gemv, down_gemv=down_gemv)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, tiles)
    ref = torch_experts(x, w13, w2, topk_weights, topk_ids)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    ("config", "dtype"),
    [(MoeGemvConfig(16, 32, 4), torch.float32), (MoeGemvConfig(8, 64, 4), torch.float32)]
    + [(None, torch.bfloat16)] * FULL,
)
def test_up_gemv_equals_silu_and_mul_of_each_pairs_expert(config, dtype) -> None:
    """On CPU (I 40, K 48): a partial last block of rows and K in two tiles, the second
    partial; or K in one partial tile. Both pairs of a token on one expert, experts unused;
    x's rows not packed."""
    num_experts, hidden, inner = SHAPE
    w13, _ = weights(dtype)
    topk_weights, topk_ids = routing([[3, 3], [0, 2]])
    x = torch.randn(2, hidden + 8, device=DEVICE).to(dtype)[:, :hidden]  # rows apart
    out = torch.empty(4, inner, device=DEVICE, dtype=dtype)
    up_gemv(x, w13, topk_ids.flatten(), out, config)
    pairs = topk_ids.flatten().long()
    gate_up = torch.einsum("ph,pnh->pn", x.float().repeat_interleave(2, 0), w13[pairs].float())
    ref = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("config", "dtype"),
    [(MoeGemvConfig(32, 32, 4), torch.float32), (MoeGemvConfig(4, 64, 2), torch.float32)]
    + [(None, torch.bfloat16)] * FULL,
)
def test_summed_down_gemv_equals_each_tokens_weighted_sum(config, dtype) -> None:
    """On CPU (H 48, I 40): a partial last block of rows and K in two tiles, the second
    partial; or K in one partial tile. Three choices a token (a fourth masked), two of one
    token on one expert, experts unused; out's rows not packed."""
    num_experts, hidden, inner = SHAPE
    _, w2 = weights(dtype)
    topk_weights, topk_ids = routing([[3, 3, 1], [0, 2, 4]])
    a = torch.randn(6, inner, device=DEVICE).to(dtype)
    out = torch.zeros(2, hidden + 8, device=DEVICE, dtype=dtype)
    summed_down_gemv(a, w2, out[:, :hidden], topk_ids.flatten(), topk_weights.flatten(), config)
    pairs = topk_ids.flatten().long()
    per_pair = torch.einsum("pi,phi->ph", a.float(), w2[pairs].float())
    ref = (per_pair.view(2, 3, hidden) * topk_weights[..., None]).sum(1)
    assert relative_error(out[:, :hidden], ref) < TOLERANCE[dtype]
    assert out[:, hidden:].eq(0).all()


def test_one_pair_tiles_only_where_pairs_rarely_share_experts() -> None:
    assert uses_one_pair_tiles(1, 8, 128) and uses_one_pair_tiles(4, 8, 128)
    assert not uses_one_pair_tiles(8, 8, 128)
    assert uses_one_pair_tiles(1, 2, 8) and not uses_one_pair_tiles(2, 2, 8)


def test_pipeline_stages_shrink_to_fit_shared_memory(monkeypatch) -> None:
    import kernels.fused_moe as fused_moe

    monkeypatch.setattr(fused_moe, "_shared_memory", lambda index: 232448)  # the H100/H200's
    cuda, tiles = torch.device("cuda", 0), MoeTileConfig(128, 128, 64, 16, 8, 4)
    assert fused_moe._stages_that_fit(tiles, 2, True, cuda) == 4  # bf16: 48 KB a stage
    assert fused_moe._stages_that_fit(tiles, 4, True, cuda) == 2  # fp32 gate and up: 96 KB
    assert fused_moe._stages_that_fit(tiles, 4, False, cuda) == 3  # fp32 down: 64 KB


@pytest.mark.parametrize("tiles", [MIXED_TILES, TMA_TILES, GEMV_TILES, DOWN_GEMV_TILES])
def test_tiles_round_trip_through_the_table_format(tiles: MoeTiles) -> None:
    assert tiles_from_json(json.loads(json.dumps(tiles_to_json(tiles)))) == tiles


def test_the_two_gemms_share_the_alignment_block() -> None:
    with pytest.raises(ValueError, match="block_m"):
        MoeTiles(SMALL_TILES, MoeTileConfig(32, 16, 16, 1, 4, 1))
    with pytest.raises(ValueError, match="tail_m"):
        MoeTiles(SMALL_TILES, SMALL_TILES, tail_m=16)  # as tall as the full tiles
