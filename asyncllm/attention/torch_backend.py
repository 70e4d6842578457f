"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

On CPU, decode rows and float32 prompt rows go to C++ kernels that read the KV blocks in place
(kernels/cpu_decode_attention.py); the torch paths below stay as their fallback and reference."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.kv_scales import UNIT_KV_SCALES, KVScales
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding
from kernels.cpu_decode_attention import (
    HEAD_DIM_MULTIPLE,
    cpu_decode_attention_available,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
)
from kernels.cpu_layer_ops import cpu_layer_ops_available, write_kv_cache_cpu

T = TypeVar("T")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_KV_SCALES,
) -> None:
    """Store new keys/values in their slots; slots < 0 are padding and skipped. An FP8 cache
    stores e4m3(key / kv_scales.k) and e4m3(value / kv_scales.v), saturated at +-448. float32
    keys on CPU go to a float32 or bf16 cache in one C++ pass."""
    if _cpu_write_fits(key, kv_cache, slot_mapping):
        write_kv_cache_cpu(key, value, kv_cache, slot_mapping)
        return
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_kv_heads, head_dim = key.shape[1:]
    key = _bytes(_for_cache(key, kv_scales.k, kv_cache))
    value = _bytes(_for_cache(value, kv_scales.v, kv_cache))
    cache = _bytes(kv_cache)
    cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _cpu_write_fits(key: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    return (
        key.device.type == "cpu"
        and key.dtype == torch.float32
        and kv_cache.dtype in (torch.float32, torch.bfloat16)
        and slot_mapping.dtype == torch.int64
        and cpu_layer_ops_available()
    )


def _for_cache(t: torch.Tensor, scale: float, kv_cache: torch.Tensor) -> torch.Tensor:
    """t as the cache stores it: for an FP8 cache divided by scale in fp32, then rounded."""
    if kv_cache.element_size() != 1:
        return t.to(kv_cache.dtype)
    limit = torch.finfo(kv_cache.dtype).max
    return (t.float() / scale).clamp(-limit, limit).to(kv_cache.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its bytes, which index_copy_ / index_select handle on CPU."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the given blocks, [*block_ids.shape, block_size, num_kv_heads, head_dim].

    index_select on each half runs 2.5x faster on CPU than advanced indexing of the pair."""
    flat = block_ids.reshape(-1).long()
    shape = (*block_ids.shape, *kv_cache.shape[2:])
    cache = _bytes(kv_cache)
    keys, values = (cache[i].index_select(0, flat).view(shape) for i in (0, 1))
    return keys.view(kv_cache.dtype), values.view(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len keys and values of one request, [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    keys, values = gather_blocks(kv_cache, block_table[: -(-seq_len // block_size)])
    return keys.flatten(0, 1)[:seq_len], values.flatten(0, 1)[:seq_len]


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [B, Hq, Q, D], key/value [B, Hkv, S, D] -> [B, Hq, Q, D]: query row i, at position
    S - Q + i, sees the keys up to its own; each KV head serves its group of query heads.

    A prompt with nothing cached (Q = S) takes SDPA's causal path and no mask, and the groups
    share their KV heads without repeat_interleave's copies: 5-15% faster on CPU at 64-500
    tokens, bit-equal (bench/NOTES.md)."""
    query_len, seq_len = query.shape[2], key.shape[2]
    causal = 1 < query_len == seq_len
    mask = None if query_len == 1 or causal else _causal_mask(query_len, seq_len, query.device)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        scale=scale,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def _causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """True where query row i (at position seq_len - query_len + i) may see key position j."""
    rows = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    return torch.arange(seq_len, device=device)[None, :] <= rows


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # int64 [n]: the requests' rows in the batch
    block_tables: torch.Tensor  # [n, blocks of the longest]
    mask: torch.Tensor  # bool [n, 1, 1, blocks * block_size]: positions within each length


DECODE_GROUP_SIZE = 4


def decode_groups(meta: AttentionMetadata, block_size: int) -> list[DecodeGroup]:
    """Requests sorted by length in groups of DECODE_GROUP_SIZE, each padded only to its own
    longest: a batch padded to its longest context gathered and attended up to twice the
    positions it needed (2.5x slower at 32 requests of 32-512 tokens)."""
    order = sorted(range(meta.num_reqs), key=meta.seq_lens_cpu.__getitem__)
    device = meta.block_tables.device
    groups = []
    for start in range(0, len(order), DECODE_GROUP_SIZE):
        rows = order[start : start + DECODE_GROUP_SIZE]
        num_blocks = -(-meta.seq_lens_cpu[rows[-1]] // block_size)
        index = torch.tensor(rows, device=device)
        lengths = torch.tensor([meta.seq_lens_cpu[r] for r in rows], device=device)
        positions = torch.arange(num_blocks * block_size, device=device)
        groups.append(
            DecodeGroup(
                rows=index,
                block_tables=meta.block_tables.index_select(0, index)[:, :num_blocks],
                mask=(positions[None, :] < lengths[:, None])[:, None, None, :],
            )
        )
    return groups


# a query of up to this many rows (a verify step's token and drafts) goes to the decode kernel
# row by row: each row rereads the request's context in place, which on CPU costs less than
# gathering it once and repeating it per query head for SDPA (in a CPU profile of SmolLM2 with
# n-gram drafts that path was most of a verify step's extra time); row i then attends exactly
# as the decode step at its position does
MAX_QUERY_AS_DECODES = 16


@dataclass
class DecodeRows:
    """The short-query requests of a step, every query row a decode row of its own."""

    requests: set[int]
    rows: torch.Tensor  # int64: their query rows
    block_tables: torch.Tensor  # each row's request's
    seq_lens: torch.Tensor  # each row's context: up to and including its own position


def decode_rows(meta: AttentionMetadata) -> DecodeRows:
    lens = meta.query_lens_cpu
    requests = [r for r, n in enumerate(lens) if n <= MAX_QUERY_AS_DECODES]
    starts = [0, *itertools.accumulate(lens)]
    owners = [r for r in requests for _ in range(lens[r])]
    rows = [starts[r] + i for r in requests for i in range(lens[r])]
    seq_lens = [meta.seq_lens_cpu[r] - lens[r] + 1 + i for r in requests for i in range(lens[r])]
    device = meta.block_tables.device
    index = torch.tensor(owners, dtype=torch.int64, device=device)
    return DecodeRows(
        requests=set(requests),
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        block_tables=meta.block_tables.index_select(0, index),
        seq_lens=torch.tensor(seq_lens, dtype=meta.seq_lens.dtype, device=device),
    )


@dataclass
class PromptRows:
    """The longer-query requests of a step, for the prompt kernel."""

    requests: set[int]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_starts: torch.Tensor  # int32: each request's first query row
    query_lens: torch.Tensor  # int32


def prompt_rows(meta: AttentionMetadata) -> PromptRows:
    lens = meta.query_lens_cpu
    requests = [r for r, n in enumerate(lens) if n > MAX_QUERY_AS_DECODES]
    starts = [0, *itertools.accumulate(lens)]
    device = meta.block_tables.device
    index = torch.tensor(requests, dtype=torch.int64, device=device)
    return PromptRows(
        requests=set(requests),
        block_tables=meta.block_tables.index_select(0, index),
        seq_lens=meta.seq_lens.index_select(0, index),
        query_starts=torch.tensor([starts[r] for r in requests], dtype=torch.int32, device=device),
        query_lens=torch.tensor([lens[r] for r in requests], dtype=torch.int32, device=device),
    )


class TorchAttentionBackend:
    def __init__(self, use_cpu_kernel: bool = True) -> None:
        """use_cpu_kernel=False keeps every step on the torch paths (the reference)."""
        self.use_cpu_kernel = use_cpu_kernel
        self.max_short_step_tokens = 0  # attention loops over the requests on the host
        # what a step's metadata implies, made by its first layer and used by every layer
        self._step_meta: AttentionMetadata | None = None
        self._step_cache: dict[str, Any] = {}

    def build_cpu_kernels(self) -> None:
        """Builds and loads the C++ decode kernel and layer ops (norm, rotary, KV cache write)
        now (a compile on a fresh install, about 1 s of checks once built) instead of in the
        first step."""
        cpu_layer_ops_available()
        if self.use_cpu_kernel:
            cpu_decode_attention_available()

    def prepare_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        heads = qkv.view(qkv.shape[0], -1, head_dim)
        num_heads = heads.shape[1] - 2 * num_kv_heads
        query, key, value = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        if q_norm is not None and k_norm is not None:
            query, key = q_norm(query), k_norm(key)
        query, key = rotary(positions, query, key)
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, kv_scales)
        return query

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        """Over an FP8 cache the keys' scale joins the softmax scale and the values' scale the
        output (kv_scales' docstring says why that equals attending over the scaled values)."""
        out = torch.empty_like(query) if out is None else out
        kv_scales = kv_scales.for_cache(kv_cache)
        scale *= kv_scales.k
        if meta.is_pure_decode:
            self._decode(query, kv_cache, meta, scale, out)
        else:
            self._varlen(query, kv_cache, meta, scale, out)
        if kv_scales.v != 1.0:
            out.mul_(kv_scales.v)
        return out

    def _varlen(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """When the kernels run, the rows of short queries together in the decode kernel and, for
        a float32 query, the longer ones in the prompt kernel; else (and a bf16 query's prompt
        rows) one request at a time on torch."""
        kernel_runs = self._kernel_runs(query, kv_cache)
        decodes = self._per_step(meta, "decode_rows", decode_rows) if kernel_runs else None
        if decodes is not None and len(decodes.requests) == meta.num_reqs:
            # a verify step: every query row is a decode row, in order (decode_rows' rows are
            # 0 .. n - 1), so the kernel reads query and writes out in place
            return paged_decode_attention_cpu(
                query, kv_cache, decodes.block_tables, decodes.seq_lens, scale, out
            )
        on_kernels: set[int] = set() if decodes is None else decodes.requests
        prompts = (
            self._per_step(meta, "prompt_rows", prompt_rows)
            if kernel_runs and query.dtype == torch.float32
            else None
        )
        if prompts is not None and prompts.requests:
            paged_prefill_attention_cpu(
                query,
                kv_cache,
                prompts.block_tables,
                prompts.seq_lens,
                prompts.query_starts,
                prompts.query_lens,
                scale,
                out,
            )
            on_kernels = on_kernels | prompts.requests
        start = 0
        for r, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if r not in on_kernels:
                k, v = (
                    t.to(query.dtype) for t in gather_kv(kv_cache, meta.block_tables[r], seq_len)
                )
                q = query[start : start + query_len].transpose(0, 1)[None]
                o = _attend(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale)
                out[start : start + query_len] = o[0].transpose(0, 1)
            start += query_len
        if decodes is not None and decodes.requests:
            decode_query = query.index_select(0, decodes.rows)
            decode_out = paged_decode_attention_cpu(
                decode_query,
                kv_cache,
                decodes.block_tables,
                decodes.seq_lens,
                scale,
                torch.empty_like(decode_query),
            )
            out.index_copy_(0, decodes.rows, decode_out)
        return out

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One query per request: all in one kernel call, or else each group of requests of
        similar lengths gathers its block tables at once and masks past each length."""
        if self._kernel_runs(query, kv_cache):
            n = meta.num_reqs
            return paged_decode_attention_cpu(
                query, kv_cache, meta.block_tables[:n], meta.seq_lens[:n], scale, out
            )
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = kv_cache.shape[-2]
        block_size = kv_cache.shape[2]
        for group in self._per_step(meta, "groups", lambda m: decode_groups(m, block_size)):
            keys, values = gather_blocks(kv_cache, group.block_tables)
            keys = keys.flatten(1, 2).transpose(1, 2).to(query.dtype)  # [B, Hkv, S, D]
            values = values.flatten(1, 2).transpose(1, 2).to(query.dtype)
            # the query heads sharing a KV head become that head's query rows: no K/V repeat
            grouped = query.index_select(0, group.rows)
            grouped = grouped.view(len(group.rows), num_kv_heads, -1, head_dim)
            o = F.scaled_dot_product_attention(
                grouped, keys, values, attn_mask=group.mask, scale=scale
            )
            out.index_copy_(0, group.rows, o.reshape(-1, num_heads, head_dim))
        return out

    def _kernel_runs(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return (
            self.use_cpu_kernel
            and query.device.type == "cpu"
            and query.dtype in (torch.float32, torch.bfloat16)
            and kv_cache.dtype in (query.dtype, torch.bfloat16)
            and query.shape[-1] % HEAD_DIM_MULTIPLE == 0
            and cpu_decode_attention_available()
        )

    def _per_step(
        self, meta: AttentionMetadata, name: str, make: Callable[[AttentionMetadata], T]
    ) -> T:
        """make(meta), once per step (a new metadata object) however many layers ask."""
        if self._step_meta is not meta:
            self._step_meta, self._step_cache = meta, {}
        if name not in self._step_cache:
            self._step_cache[name] = make(meta)
        return self._step_cache[name]
