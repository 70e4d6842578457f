"""Sampling kernels on [B, V] logits: a few passes per row, each reading the logits once.

penalize: presence / frequency / repetition penalties in place, at the distinct tokens of each
row's history only (the rest of the row is untouched).
prepare_logits: one pass per row gives its argmax, and for z = logits / temperature its max,
logsumexp and the maximum of every TILE tokens; rows without top-k / top-p / min-p sample there
too, by the exponential race argmax(z - log E), E ~ Exp(1).
sample_masked: rows with top-k / top-p / min-p. A lower bound of the row's cutoff (the least
value it keeps) comes from its tile maxima; one pass gathers the values above it, and if they
fit the buffer the cutoff is found among them (pairwise ranks and masses), else over the whole
row by bisection. The race then runs over the kept tokens.
row_logprobs: the chosen token's logprob and rank and each row's top n, in one pass of [B, V]
blocks and a merge per row.

A row's random numbers are Philox4x32 draws at (seed, counter << 32 | token id // 4), lane
token id % 4: a seeded row's counter is the number of tokens its request had sampled, so its
draws depend on nothing else in the batch. Divisions are IEEE (tl.div_rn, not the GPU's fast
approximate one), so values at a cutoff compare as they do in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2
from kernels.sampling_rows import GREEDY_MASKED, MASKED, RACE, Penalties, RowKeys

_RACE = tl.constexpr(RACE)
_MASKED = tl.constexpr(MASKED)
_GREEDY_MASKED = tl.constexpr(GREEDY_MASKED)
_INT64_MIN = tl.constexpr(-(2**63))


@dataclass(frozen=True)
class RowStats:
    """What prepare_logits learns of each row; sampled holds the rows sampled so far."""

    argmax: torch.Tensor  # int64 [B]
    peak: torch.Tensor  # float32 [B]: max of z
    lse: torch.Tensor  # float32 [B]: logsumexp of z
    tile_max: torch.Tensor  # float32 [B, ceil(V / TILE)]
    sampled: torch.Tensor  # int64 [B]


@triton.jit
def _key(value):
    """An int32 that orders like the float32 value."""
    bits = value.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    key = key.to(tl.int32)
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _uniforms(seed, counter, token_ids):
    """U[0, 1) draws for token_ids: lane id % 4 of Philox4x32 at (seed, counter << 32 | id // 4)."""
    u0, u1, u2, u3 = tl.rand4x(seed, (counter << 32) | (token_ids >> 2).to(tl.int64))
    lane = token_ids & 3
    return tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))


@triton.jit
def _block_uniforms(seed, counter, start, BLOCK: tl.constexpr):
    """_uniforms of the tokens start .. start + BLOCK - 1 (start a multiple of 4), with one
    Philox call per four of them."""
    quads = (start >> 2) + tl.arange(0, BLOCK // 4)
    u0, u1, u2, u3 = tl.rand4x(seed, (counter << 32) | quads.to(tl.int64))
    # join adds a minor axis: [quad, j, k] holds lane 2j + k
    return tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (BLOCK,))


@triton.jit
def _race_scores(z, uniforms):
    """z - log(E), E = -log(U) ~ Exp(1): the argmax over a set of tokens draws from softmax(z)
    on it."""
    return z - tl.log(-tl.log(uniforms))


@triton.jit
def _row_key(row, seed_ptr, seeded_ptr, num_sampled_ptr, step, fresh_seed):
    seeded = tl.load(seeded_ptr + row) != 0
    seed = tl.where(seeded, tl.load(seed_ptr + row), fresh_seed)
    counter = tl.where(seeded, tl.load(num_sampled_ptr + row) + step, row)
    return seed, counter


@triton.jit
def _penalize_kernel(
    logits_ptr,
    logits_stride,
    slot_ptr,
    presence_ptr,
    frequency_ptr,
    repetition_ptr,
    counts_ptr,
    history_stride,
    tokens_ptr,
    tokens_stride,
    lengths_ptr,
    saved_ptr,
    SAVE: tl.constexpr,
    RESTORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """repetition over prompt and output tokens, then frequency and presence over the output,
    at each distinct token once; SAVE keeps the values found in saved, RESTORE puts them back."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        n = tl.load(lengths_ptr + slot)
        presence = tl.load(presence_ptr + row)
        frequency = tl.load(frequency_ptr + row)
        repetition = tl.load(repetition_ptr + row)
        row_ptr = logits_ptr + row * logits_stride
        for start in range(0, n, BLOCK):
            j = start + tl.arange(0, BLOCK)
            valid = j < n
            token = tl.load(tokens_ptr + slot * tokens_stride + j, mask=valid, other=0)
            saved = saved_ptr + row * tokens_stride + j
            if RESTORE:
                tl.store(row_ptr + token, tl.load(saved, mask=valid), mask=valid)
            else:
                x = tl.load(row_ptr + token, mask=valid)
                if SAVE:
                    tl.store(saved, x, mask=valid)
                counts = tl.load(counts_ptr + slot * history_stride + token, mask=valid, other=0)
                # every listed token is in the prompt or the output: the repetition applies
                x = tl.where(x > 0, tl.div_rn(x, repetition), x * repetition)
                x -= frequency * counts.to(tl.float32)
                x -= tl.where(counts > 0, presence, 0.0)
                tl.store(row_ptr + token, x, mask=valid)


@triton.jit
def _record_kernel(
    sampled_ptr,
    rows_ptr,
    slots_ptr,
    counts_ptr,
    seen_ptr,
    history_stride,
    tokens_ptr,
    tokens_stride,
    lengths_ptr,
):
    """Counts the token a penalised row sampled, and lists it if it is new to the row."""
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    token = tl.load(sampled_ptr + tl.load(rows_ptr + i))
    count_ptr = counts_ptr + slot * history_stride + token
    count = tl.load(count_ptr)
    new = (count == 0) & (tl.load(seen_ptr + slot * history_stride + token) == 0)
    length = tl.load(lengths_ptr + slot)
    # written whether new or not: past the end of the list unless its length grows
    tl.store(tokens_ptr + slot * tokens_stride + length, token.to(tl.int32))
    tl.store(lengths_ptr + slot, length + new.to(tl.int32))
    tl.store(count_ptr, count + 1)


@triton.jit(do_not_specialize=["step", "fresh_seed"])
def _prepare_kernel(
    logits_ptr,
    logits_stride,
    vocab,
    temperature_ptr,
    mode_ptr,
    seed_ptr,
    seeded_ptr,
    num_sampled_ptr,
    step,
    fresh_seed,
    argmax_ptr,
    peak_ptr,
    lse_ptr,
    tile_max_ptr,
    tile_max_stride,
    sampled_ptr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    """One pass over a row of z = logits / temperature: its statistics, and its race."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    races = tl.load(mode_ptr + row) == _RACE
    seed, counter = _row_key(row, seed_ptr, seeded_ptr, num_sampled_ptr, step, fresh_seed)
    best = tl.full((), float("-inf"), tl.float32)
    best_col = 0
    race_best = tl.full((), float("-inf"), tl.float32)
    race_col = 0
    peak = tl.full((), float("-inf"), tl.float32)
    total = 0.0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=valid, other=float("-inf"))
        z = tl.div_rn(x, temperature)
        tiles = tl.max(tl.reshape(z, (BLOCK // TILE, TILE)), axis=1)
        tile_ids = start // TILE + tl.arange(0, BLOCK // TILE)
        tile_ptrs = tile_max_ptr + row * tile_max_stride + tile_ids
        tl.store(tile_ptrs, tiles, mask=tile_ids * TILE < vocab)
        block_max = tl.max(tiles, 0)
        if block_max > best:
            best = block_max
            best_col = start + tl.argmax(z, 0)
        # online logsumexp; a shift of 0 while everything so far is -inf avoids inf - inf
        new_peak = tl.maximum(peak, block_max)
        shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        total = total * tl.exp(peak - shift) + tl.sum(tl.exp(z - shift), 0)
        peak = new_peak
        if races:
            uniforms = _block_uniforms(seed, counter, start, BLOCK)
            scores = tl.where(valid, _race_scores(z, uniforms), float("-inf"))
            block_best = tl.max(scores, 0)
            if block_best > race_best:
                race_best = block_best
                race_col = start + tl.argmax(scores, 0)
    tl.store(argmax_ptr + row, best_col)
    tl.store(peak_ptr + row, peak)
    tl.store(lse_ptr + row, peak + tl.log(total))
    tl.store(sampled_ptr + row, tl.where(race_best > float("-inf"), race_col, best_col))


@triton.jit
def _count_and_mass(src_ptr, n, scale, threshold, peak, BLOCK: tl.constexpr):
    """How many of src[:n] / scale are >= threshold, and their sum of exp(value - peak)."""
    count = 0
    mass = 0.0
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.div_rn(tl.load(src_ptr + cols, mask=cols < n, other=float("-inf")), scale)
        kept = (cols < n) & (values >= threshold)
        count += tl.sum(kept.to(tl.int32), 0)
        mass += tl.sum(tl.where(kept, tl.exp(values - peak), 0.0), 0)
    return count, mass


@triton.jit
def _largest_threshold(src_ptr, n, scale, low, target, peak, BY_MASS: tl.constexpr, BLOCK):
    """The largest t in [low, peak] whose count (BY_MASS: mass) of src[:n] / scale >= t reaches
    target; low if none. The count and mass only change at values of src, so t is one of them."""
    lo = _key(low).to(tl.int64)
    hi = _key(peak).to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        count, mass = _count_and_mass(src_ptr, n, scale, _value(mid), peak, BLOCK)
        enough = mass >= target if BY_MASS else count >= target
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    return _value(lo)


@triton.jit
def _race(src_ptr, ids_ptr, has_ids, n, scale, cutoff, seed, counter, first, BLOCK: tl.constexpr):
    """The race over the values of src[:n] / scale >= cutoff; their token ids are ids[:n] if
    has_ids, else their positions. first: the answer if every score is -inf."""
    best = tl.full((), float("-inf"), tl.float32)
    best_id = first.to(tl.int32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < n
        values = tl.div_rn(tl.load(src_ptr + cols, mask=valid, other=float("-inf")), scale)
        from_ids = (cols * 0 + has_ids) != 0  # a vector: the interpreter mis-broadcasts masks
        ids = tl.where(from_ids, tl.load(ids_ptr + cols, mask=valid & from_ids, other=0), cols)
        scores = _race_scores(values, _uniforms(seed, counter, ids))
        scores = tl.where(valid & (values >= cutoff), scores, float("-inf"))
        block_best = tl.max(scores, 0)
        if block_best > best:
            best = block_best
            winner = tl.argmax(scores, 0)
            best_id = tl.sum(tl.where(tl.arange(0, BLOCK) == winner, ids, 0), 0)
    return best_id


@triton.jit
def _pairwise(src_ptr, n, values, peak, CHUNK: tl.constexpr):
    """For each of values: how many of src[:n] are greater, and the sum of exp(x - peak) over
    the x of src[:n] greater than it, and over those greater or equal."""
    above = tl.zeros(values.shape, tl.int32)
    mass_above = tl.zeros(values.shape, tl.float32)
    mass_from = tl.zeros(values.shape, tl.float32)
    for start in range(0, n, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        others = tl.load(src_ptr + cols, mask=cols < n, other=float("-inf"))
        weights = tl.where(cols < n, tl.exp(others - peak), 0.0)[None, :]
        greater = others[None, :] > values[:, None]
        above += tl.sum(greater.to(tl.int32), 1)
        mass_above += tl.sum(tl.where(greater, weights, 0.0), 1)
        mass_from += tl.sum(tl.where(others[None, :] >= values[:, None], weights, 0.0), 1)
    return above, mass_above, mass_from


@triton.jit
def _cutoff_bound(tiles_ptr, num_tiles, peak, lse, top_k, top_p, TILES: tl.constexpr, CHUNK):
    """A lower bound of a row's cutoff from its tile maxima alone: the top_k-th largest of
    them, or the largest with a top_p share of the row's mass among them at or above it."""
    index = tl.arange(0, TILES)
    maxima = tl.load(tiles_ptr + index, mask=index < num_tiles, other=float("-inf"))
    above, _, mass_from = _pairwise(tiles_ptr, num_tiles, maxima, peak, CHUNK)
    bound = tl.full((), float("-inf"), tl.float32)
    if top_k > 0:
        top = tl.min(tl.where(above < top_k, maxima, float("inf")), 0)
        bound = tl.where(num_tiles >= top_k, top, bound)
    elif top_p < 1.0:
        share = top_p * tl.exp(lse - peak)
        bound = tl.max(tl.where(mass_from >= share, maxima, float("-inf")), 0)
    return bound


@triton.jit
def _candidate_cutoff(
    candidate_ptr, n, peak, floor, top_k, top_p, mass_above_floor, CAPACITY: tl.constexpr, CHUNK
):
    """The cutoff from candidates[:n], which hold every value of the row at or above it: the
    least value at or above floor with fewer than top_k values above it, and less than top_p
    of the mass kept so far above it."""
    index = tl.arange(0, CAPACITY)
    z = tl.load(candidate_ptr + index, mask=index < n, other=float("-inf"))
    above, mass_above, _ = _pairwise(candidate_ptr, n, z, peak, CHUNK)
    kept = (index < n) & (z >= floor)
    total = mass_above_floor
    if top_k > 0:
        kept = kept & (above < top_k)
        total = tl.sum(tl.where(kept, tl.exp(z - peak), 0.0), 0)
    if top_p < 1.0:
        kept = kept & (mass_above < top_p * total)
    return tl.min(tl.where(kept, z, float("inf")), 0)


@triton.jit
def _row_cutoff(
    row_ptr, vocab, scale, peak, floor, top_k, top_p, mass_above_floor, BLOCK: tl.constexpr
):
    """The same cutoff over the whole row (row / scale), by bisection: for rows whose
    candidates overflow."""
    cutoff = floor
    if top_k > 0:
        kth = _largest_threshold(row_ptr, vocab, scale, floor, top_k, peak, False, BLOCK)
        cutoff = tl.maximum(cutoff, kth)
    if top_p < 1.0:
        total = mass_above_floor
        if top_k > 0:
            _, total = _count_and_mass(row_ptr, vocab, scale, cutoff, peak, BLOCK)
        target = top_p * total
        cutoff = _largest_threshold(row_ptr, vocab, scale, cutoff, target, peak, True, BLOCK)
    return cutoff


@triton.jit(do_not_specialize=["step", "fresh_seed"])
def _sample_masked_kernel(
    logits_ptr,
    logits_stride,
    vocab,
    temperature_ptr,
    tile_max_ptr,
    tile_max_stride,
    num_tiles,
    peak_ptr,
    lse_ptr,
    argmax_ptr,
    mode_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    seeded_ptr,
    num_sampled_ptr,
    step,
    fresh_seed,
    candidate_ptr,
    candidate_id_ptr,
    sampled_ptr,
    cutoff_ptr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    GREEDY_CUTOFFS: tl.constexpr,
    CAPACITY: tl.constexpr,
    TILES: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Cutoff and race of one row of z = logits / temperature: min-p, then top-k among the
    rest, then top-p among those."""
    row = tl.program_id(0).to(tl.int64)
    mode = tl.load(mode_ptr + row)
    active = mode == _MASKED
    if GREEDY_CUTOFFS:
        active = active | (mode == _GREEDY_MASKED)
    if active:
        temperature = tl.load(temperature_ptr + row)
        peak = tl.load(peak_ptr + row)
        top_k = 0
        top_p = 1.0
        floor = tl.full((), float("-inf"), tl.float32)
        if HAS_TOP_K:
            top_k = tl.load(top_k_ptr + row)
        if HAS_TOP_P:
            top_p = tl.load(top_p_ptr + row)
        if HAS_MIN_P:
            min_p = tl.load(min_p_ptr + row)
            floor = tl.where(min_p > 0, peak + tl.log(min_p), floor)
        tiles = tile_max_ptr + row * tile_max_stride
        lse = tl.load(lse_ptr + row)
        bound = _cutoff_bound(tiles, num_tiles, peak, lse, top_k, top_p, TILES, CHUNK)
        low = tl.maximum(floor, bound)
        candidates = candidate_ptr + row * CAPACITY
        candidate_ids = candidate_id_ptr + row * CAPACITY
        row_ptr = logits_ptr + row * logits_stride
        n = 0
        # top-p without top-k normalises over the whole row (what min-p keeps of it)
        whole_row_mass = (top_k <= 0) & (top_p < 1.0)
        mass_above_floor = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < vocab
            z = tl.div_rn(tl.load(row_ptr + cols, mask=valid, other=float("-inf")), temperature)
            keep = valid & (z >= low)
            slots = n + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(candidates + slots, z, mask=keep & (slots < CAPACITY))
            tl.store(candidate_ids + slots, cols, mask=keep & (slots < CAPACITY))
            n += tl.sum(keep.to(tl.int32), 0)
            if whole_row_mass:
                kept = valid & (z >= floor)
                mass_above_floor += tl.sum(tl.where(kept, tl.exp(z - peak), 0.0), 0)
        tl.debug_barrier()  # the candidates written above are read back by other threads
        fits = n <= CAPACITY
        if fits:
            cutoff = _candidate_cutoff(
                candidates, n, peak, floor, top_k, top_p, mass_above_floor, CAPACITY, CHUNK
            )
        else:
            cutoff = _row_cutoff(
                row_ptr, vocab, temperature, peak, floor, top_k, top_p, mass_above_floor, BLOCK
            )
        tl.store(cutoff_ptr + row, cutoff)
        if mode == _MASKED:
            seed, counter = _row_key(row, seed_ptr, seeded_ptr, num_sampled_ptr, step, fresh_seed)
            src = tl.where(fits, candidates, row_ptr)
            length = tl.where(fits, n, vocab)
            scale = tl.where(fits, 1.0, temperature)
            first = tl.load(argmax_ptr + row)
            token = _race(
                src,
                candidate_ids,
                fits.to(tl.int32),
                length,
                scale,
                cutoff,
                seed,
                counter,
                first,
                BLOCK,
            )
            tl.store(sampled_ptr + row, token.to(tl.int64))


@triton.jit
def _sort_key(values, cols):
    """int64 keys ordering by value, then by smaller column: their max is a top-1."""
    return (_key(values).to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _logprob_source(src_ptr, cols, mask, row, temperature_ptr, cutoff_ptr, PROCESSED):
    """src at cols; PROCESSED: divided by the row's temperature, -inf below its cutoff."""
    values = tl.load(src_ptr + cols, mask=mask, other=float("-inf"))
    if PROCESSED:
        values = tl.div_rn(values, tl.load(temperature_ptr + row))
        values = tl.where(values >= tl.load(cutoff_ptr + row), values, float("-inf"))
    return values


@triton.jit
def _logprob_blocks_kernel(
    src_ptr,
    src_stride,
    vocab,
    temperature_ptr,
    cutoff_ptr,
    token_ptr,
    block_max_ptr,
    block_sum_ptr,
    block_above_ptr,
    block_top_ptr,
    num_top,
    PROCESSED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One block of a row: its max and sum of exp, how many beat the chosen token, its top n."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    num_blocks = tl.num_programs(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    row_ptr = src_ptr + row * src_stride
    values = _logprob_source(row_ptr, cols, valid, row, temperature_ptr, cutoff_ptr, PROCESSED)
    token = tl.load(token_ptr + row)
    chosen = _logprob_source(row_ptr, token, True, row, temperature_ptr, cutoff_ptr, PROCESSED)
    out = row * num_blocks + block
    peak = tl.max(values, 0)
    shift = tl.where(peak == float("-inf"), 0.0, peak)
    tl.store(block_max_ptr + out, peak)
    tl.store(block_sum_ptr + out, tl.sum(tl.exp(values - shift), 0))
    tl.store(block_above_ptr + out, tl.sum((values > chosen).to(tl.int32), 0))
    keys = tl.where(valid, _sort_key(values, cols), _INT64_MIN)
    for i in range(num_top):
        top = tl.max(keys, 0)
        tl.store(block_top_ptr + out * num_top + i, top)
        keys = tl.where(keys == top, _INT64_MIN, keys)


@triton.jit
def _logprob_merge_kernel(
    src_ptr,
    src_stride,
    temperature_ptr,
    cutoff_ptr,
    token_ptr,
    block_max_ptr,
    block_sum_ptr,
    block_above_ptr,
    block_top_ptr,
    num_blocks,
    num_top,
    token_logprob_ptr,
    rank_ptr,
    top_id_ptr,
    top_logprob_ptr,
    PROCESSED: tl.constexpr,
    BLOCKS: tl.constexpr,
    KEYS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, BLOCKS)
    per_block = row * num_blocks + blocks
    in_row = blocks < num_blocks
    maxes = tl.load(block_max_ptr + per_block, mask=in_row, other=float("-inf"))
    sums = tl.load(block_sum_ptr + per_block, mask=in_row, other=0.0)
    peak = tl.max(maxes, 0)
    lse = peak + tl.log(tl.sum(sums * tl.exp(maxes - peak), 0))
    above = tl.load(block_above_ptr + per_block, mask=in_row, other=0)
    tl.store(rank_ptr + row, tl.sum(above, 0).to(tl.int64) + 1)
    row_ptr = src_ptr + row * src_stride
    token = tl.load(token_ptr + row)
    chosen = _logprob_source(row_ptr, token, True, row, temperature_ptr, cutoff_ptr, PROCESSED)
    tl.store(token_logprob_ptr + row, chosen - lse)
    entries = tl.arange(0, KEYS)
    num_keys = num_blocks * num_top
    keys = tl.load(
        block_top_ptr + row * num_keys + entries, mask=entries < num_keys, other=_INT64_MIN
    )
    for i in range(num_top):
        top = tl.max(keys, 0)
        tl.store(top_id_ptr + row * num_top + i, 0x7FFFFFFF - (top & 0xFFFFFFFF))
        tl.store(top_logprob_ptr + row * num_top + i, _value(top >> 32) - lse)
        keys = tl.where(keys == top, _INT64_MIN, keys)


def _block(vocab: int, block: int) -> int:
    return min(block, max(next_pow2(vocab), 16))


def penalize(logits: torch.Tensor, penalties: Penalties, saved: torch.Tensor | None = None) -> None:
    """Applies the penalties to logits [B, V] in place; saved [B, L] (L = tokens.shape[1])
    keeps the values it replaced, for restore()."""
    _launch_penalize(logits, penalties, saved, restore=False)


def restore(logits: torch.Tensor, penalties: Penalties, saved: torch.Tensor) -> None:
    """Puts back the values penalize() replaced."""
    _launch_penalize(logits, penalties, saved, restore=True)


def _launch_penalize(
    logits: torch.Tensor, p: Penalties, saved: torch.Tensor | None, restore: bool
) -> None:
    _penalize_kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        p.slot,
        p.presence,
        p.frequency,
        p.repetition,
        p.counts,
        p.counts.stride(0),
        p.tokens,
        p.tokens.stride(0),
        p.lengths,
        saved if saved is not None else logits,
        SAVE=saved is not None,
        RESTORE=restore,
        BLOCK=256,
        num_warps=4,
    )


def record(
    sampled: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """For each i: counts[slots[i], t] += 1 with t = sampled[rows[i]], and t appended to the
    distinct tokens of slots[i] (tokens, lengths) unless counted or seen before. Slots distinct;
    tokens needs a free column after every list."""
    _record_kernel[(rows.shape[0],)](
        sampled,
        rows,
        slots,
        counts,
        seen,
        counts.stride(0),
        tokens,
        tokens.stride(0),
        lengths,
        num_warps=1,
    )


def prepare_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    mode: torch.Tensor,
    keys: RowKeys,
    block: int = 2048,
    tile: int = 256,
) -> RowStats:
    """Statistics of z = logits [B, V] / temperature, row by row; rows whose mode is RACE are
    sampled, the others get their argmax."""
    rows, vocab = logits.shape
    block = _block(vocab, block)
    tile = min(tile, block)
    device = logits.device
    num_tiles = triton.cdiv(vocab, tile)
    stats = RowStats(
        argmax=torch.empty(rows, dtype=torch.int64, device=device),
        peak=torch.empty(rows, dtype=torch.float32, device=device),
        lse=torch.empty(rows, dtype=torch.float32, device=device),
        tile_max=torch.empty(rows, num_tiles, dtype=torch.float32, device=device),
        sampled=torch.empty(rows, dtype=torch.int64, device=device),
    )
    _prepare_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        temperature,
        mode,
        keys.seed,
        keys.seeded,
        keys.num_sampled,
        keys.step,
        keys.fresh_seed,
        stats.argmax,
        stats.peak,
        stats.lse,
        stats.tile_max,
        num_tiles,
        stats.sampled,
        BLOCK=block,
        TILE=tile,
        num_warps=8,
    )
    return stats


def sample_masked(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    stats: RowStats,
    mode: torch.Tensor,
    keys: RowKeys,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    greedy_cutoffs: bool = False,
    capacity: int = 1024,
    block: int = 2048,
    chunk: int = 8,
) -> torch.Tensor:
    """Samples the MASKED rows of z = logits / temperature into stats.sampled and returns
    every row's cutoff, the least value of z it keeps: -inf on rows without masks, and on
    GREEDY_MASKED rows unless greedy_cutoffs. capacity (a power of 2): candidates per row
    before a row falls back to bisection over all its values."""
    rows, vocab = logits.shape
    device = logits.device
    num_tiles = stats.tile_max.shape[1]
    cutoff = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)
    candidates = torch.empty(rows, capacity, dtype=torch.float32, device=device)
    candidate_ids = torch.empty(rows, capacity, dtype=torch.int32, device=device)
    _sample_masked_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        temperature,
        stats.tile_max,
        stats.tile_max.stride(0),
        num_tiles,
        stats.peak,
        stats.lse,
        stats.argmax,
        mode,
        top_k if top_k is not None else mode,
        top_p if top_p is not None else cutoff,
        min_p if min_p is not None else cutoff,
        keys.seed,
        keys.seeded,
        keys.num_sampled,
        keys.step,
        keys.fresh_seed,
        candidates,
        candidate_ids,
        stats.sampled,
        cutoff,
        HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None,
        HAS_MIN_P=min_p is not None,
        GREEDY_CUTOFFS=greedy_cutoffs,
        CAPACITY=capacity,
        TILES=next_pow2(num_tiles),
        BLOCK=_block(vocab, block),
        CHUNK=chunk,
        num_warps=8,
    )
    return cutoff


def row_logprobs(
    src: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: int,
    temperature: torch.Tensor | None = None,
    cutoff: torch.Tensor | None = None,
    block: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax of src [B, V] without writing it (with temperature and cutoff: of src /
    temperature, -inf below the row's cutoff): the logprob and rank (1 = most likely) of
    token_ids [B], and the top num_top ids and logprobs of each row."""
    rows, vocab = src.shape
    device = src.device
    processed = temperature is not None
    token_ids = token_ids.contiguous()
    block = _block(vocab, block)
    num_blocks = triton.cdiv(vocab, block)
    block_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=device)
    block_sum = torch.empty_like(block_max)
    block_above = torch.empty(rows, num_blocks, dtype=torch.int32, device=device)
    block_top = torch.empty(rows, num_blocks, num_top, dtype=torch.int64, device=device)
    temperature = temperature.contiguous() if processed else block_max
    cutoff = cutoff.contiguous() if processed else block_max
    _logprob_blocks_kernel[(rows, num_blocks)](
        src,
        src.stride(0),
        vocab,
        temperature,
        cutoff,
        token_ids,
        block_max,
        block_sum,
        block_above,
        block_top,
        num_top,
        PROCESSED=processed,
        BLOCK=block,
        num_warps=8,
    )
    token_logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    ranks = torch.empty(rows, dtype=torch.int64, device=device)
    top_ids = torch.empty(rows, num_top, dtype=torch.int64, device=device)
    top_logprobs = torch.empty(rows, num_top, dtype=torch.float32, device=device)
    _logprob_merge_kernel[(rows,)](
        src,
        src.stride(0),
        temperature,
        cutoff,
        token_ids,
        block_max,
        block_sum,
        block_above,
        block_top,
        num_blocks,
        num_top,
        token_logprobs,
        ranks,
        top_ids,
        top_logprobs,
        PROCESSED=processed,
        BLOCKS=next_pow2(num_blocks),
        KEYS=next_pow2(max(num_blocks * num_top, 1)),
        num_warps=4,
    )
    return token_logprobs, ranks, top_ids, top_logprobs
