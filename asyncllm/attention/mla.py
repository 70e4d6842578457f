"""Multi-head latent attention (DeepSeek-V2) over a paged cache of compressed latents.

Each token's cache entry is one vector per layer, not per head: its latent c (kv_lora_rank
entries, already normalised) followed by its rotated rope key (qk_rope_head_dim entries); the
cache is [1, num_blocks, block_size, 1, kv_lora_rank + rope_dim] (KVCacheSpec(1, 1, ...)).
The up-projection kv_b_proj [H * (nope + v), kv_lora_rank] turns c into each head's key
(W_UK) and value (W_UV).

Prompt chunks go through the up-projections: keys and values per head for their contexts, then
attention as usual, every prompt chunk of a step in one variable-length flash call on a GPU. Decode absorbs them: q_nope @ W_UK is a query in latent space, scored
against the latents and rope keys as one shared head (MQA with head dim kv_lora_rank + rope_dim),
and the latent output goes through W_UV; each step reads only the latents (kernels.mla_decode
on CUDA). Steps of up to max_absorbed_rows rows (the backend's max_short_step_tokens, whose
steps CUDA graphs capture whole) take the absorbed path for every row: it reads no host metadata.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from asyncllm.attention.backend import AttentionMetadata
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class MLADims:
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scale: float


def write_latent_cache(
    latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """latent [T, kv_lora_rank + rope_dim] into its slots; slots < 0 are padding and skipped."""
    if latent.is_cuda:  # the kernel skips padding without a host sync
        kernels.write_latent_cache(latent, kv_cache, slot_mapping)
        return
    valid = slot_mapping >= 0
    latent = latent[valid].to(kv_cache.dtype)  # bfloat16 on CPU: a bf16 cache, fp32 latents
    kv_cache[0].view(-1, latent.shape[1]).index_copy_(0, slot_mapping[valid], latent)


def norm_rope_and_cache(
    query: torch.Tensor,
    latent: torch.Tensor,
    positions: torch.Tensor,
    rotary: RotaryEmbedding,
    latent_norm: RMSNorm,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """query [T, H, nope + rope]: its rope parts rotated in place. latent [T, rank + rope], the
    kv_a projection's output: its first rank entries normalised and its rope key rotated, into
    kv_cache at slot_mapping. On CUDA one launch (kernels.mla_norm_rope_and_cache)."""
    if latent.is_cuda:
        kernels.mla_norm_rope_and_cache(
            query,
            latent,
            positions,
            rotary.cos_sin_cache,
            latent_norm.weight,
            latent_norm.eps,
            kv_cache,
            slot_mapping,
        )
        return
    rope = rotary.cos_sin_cache.shape[-1]
    rank = latent.shape[1] - rope
    rotary.rotate_(positions, query[..., -rope:], latent[:, None, rank:])
    latent_norm.normalize_(latent[:, :rank])
    write_latent_cache(latent, kv_cache, slot_mapping)


def row_contexts(meta: AttentionMetadata, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, its request and how many context positions it sees (causally), on the
    device: (request int32 [num_rows], length int32 [num_rows]). Padding rows get length 0.
    Computed once a step, by the first layer (about 16 small launches; the step's pure decodes:
    one)."""
    return meta.once(("mla_row_contexts", num_rows), lambda: _row_contexts(meta, num_rows))


def _row_contexts(meta: AttentionMetadata, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.arange(num_rows, device=meta.seq_lens.device, dtype=torch.int32)
    if meta.is_pure_decode and num_rows == meta.seq_lens.shape[0]:
        return rows, meta.seq_lens  # a token a request: row r is request r's last position
    ends = meta.query_start_loc[1:]
    request = torch.searchsorted(ends, rows, right=True).clamp_(max=ends.numel() - 1)
    seq_len = meta.seq_lens.long()[request]
    length = seq_len - (ends.long()[request] - rows) + 1
    length = torch.where(length <= seq_len, length, torch.zeros_like(length)).clamp_(min=0)
    return request.to(torch.int32), length.to(torch.int32)


def up_projections(kv_b_weight: torch.Tensor, dims: MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, nope, rank], W_UV [H, v, rank]) as views of kv_b_proj's weight."""
    per_head = kv_b_weight.view(dims.num_heads, -1, dims.kv_lora_rank)
    return per_head.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=1)


def attend_latent_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    request: torch.Tensor,
    length: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """The reference of kernels.mla_decode: query [T, H, rank + rope] against each row's first
    length[t] latents of its request's blocks -> [T, H, rank] (zeros where length is 0)."""
    block_size = kv_cache.shape[2]
    cache = kv_cache[0, :, :, 0]
    out = torch.zeros(*query.shape[:2], kv_lora_rank, dtype=query.dtype, device=query.device)
    for t, (r, n) in enumerate(zip(request.tolist(), length.tolist())):
        if n == 0:
            continue
        latents = cache[block_tables[r, : -(-n // block_size)].long()].flatten(0, 1)[:n]
        scores = (query[t].float() @ latents.float().T) * scale
        out[t] = (scores.softmax(-1) @ latents[:, :kv_lora_rank].float()).to(query.dtype)
    return out


def attend_absorbed(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    request: torch.Tensor,
    length: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    dims: MLADims,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, H, nope + rope] -> [T, H, v] through the latent space; counters: the CUDA
    kernel's for a folded merge (fold_counters), None to have it zero its own."""
    q_nope, q_pe = query.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
    q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)
    absorbed = torch.cat([q_latent, q_pe], dim=-1)
    args = (absorbed, kv_cache, block_tables, request, length, dims.scale, dims.kv_lora_rank)
    if query.is_cuda:
        out_latent = kernels.paged_mla_decode(*args, counters=counters)
    else:
        out_latent = attend_latent_torch(*args)
    # per head into [T, H, v] directly (cuBLAS writes the strided rows): o_proj reads it flat,
    # where the einsum's [H, T, v] layout cost a copy a layer at every batch above 1
    out = out_latent.new_empty(*out_latent.shape[:2], dims.v_head_dim)
    torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out


@dataclass(frozen=True)
class MixedPlan:
    """A mixed step's rows in two groups: the prompt chunks' (requests of more than one query
    row), which attend over their contexts' latents expanded per head in one variable-length
    call, and the rest (decodes), absorbed in one call. Built on the device from the step's
    metadata, sizes from its host copies: a host-to-device copy from pageable memory would wait
    for the stream."""

    prompt_rows: torch.Tensor  # int64 [Tp]
    decode_rows: torch.Tensor  # int64 [Td]
    context_slots: torch.Tensor  # int64 [Sk]: the prompts' context positions' slots, in turn
    cu_q: torch.Tensor  # int32 [P + 1]: each prompt's first row among prompt_rows
    cu_k: torch.Tensor  # int32 [P + 1]: each prompt's first position among context_slots
    cu_q_host: list[int]
    cu_k_host: list[int]

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in itertools.pairwise(self.cu_q_host))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in itertools.pairwise(self.cu_k_host))


def mixed_plan(meta: AttentionMetadata, num_rows: int, block_size: int) -> MixedPlan:
    """The plan of a step of num_rows rows (padding included) that has a prompt chunk; about
    twenty small launches, once a step."""
    prompts = [r for r, n in enumerate(meta.query_lens_cpu) if n > 1]
    cu_q_host = [0, *itertools.accumulate(meta.query_lens_cpu[r] for r in prompts)]
    cu_k_host = [0, *itertools.accumulate(meta.seq_lens_cpu[r] for r in prompts)]
    num_decode_rows = sum(meta.query_lens_cpu) - cu_q_host[-1]
    request, length = row_contexts(meta, num_rows)
    query_lens = meta.query_start_loc.diff()
    is_prompt = query_lens > 1
    prompt_ids = torch.nonzero_static(is_prompt, size=len(prompts)).flatten()
    row_is_prompt = is_prompt[request]
    real = length > 0  # not padding
    prompt_rows = torch.nonzero_static(row_is_prompt & real, size=cu_q_host[-1]).flatten()
    decode_rows = torch.nonzero_static(~row_is_prompt & real, size=num_decode_rows).flatten()
    seq_lens = meta.seq_lens[prompt_ids]
    cu_k = F.pad(seq_lens.cumsum(0), (1, 0)).to(torch.int32)
    cu_q = F.pad(query_lens[prompt_ids].cumsum(0), (1, 0)).to(torch.int32)
    total = cu_k_host[-1]
    owner = torch.repeat_interleave(prompt_ids, seq_lens, output_size=total)
    first = torch.repeat_interleave(cu_k[:-1], seq_lens, output_size=total)
    position = torch.arange(total, device=first.device) - first
    blocks = meta.block_tables[owner, position // block_size].long()
    slots = blocks * block_size + position % block_size
    return MixedPlan(prompt_rows, decode_rows, slots, cu_q, cu_k, cu_q_host, cu_k_host)


def attend_prompts(
    query: torch.Tensor,
    latents: torch.Tensor,
    kv_b_weight: torch.Tensor,
    plan: MixedPlan,
    dims: MLADims,
) -> torch.Tensor:
    """The prompt chunks' rows [Tp, H, nope + rope] over their contexts' latents
    [Sk, rank + rope] (plan.context_slots), keys and values expanded per head by kv_b_proj
    -> [Tp, H, v]."""
    c, k_pe = latents.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
    expanded = (c @ kv_b_weight.T).view(c.shape[0], dims.num_heads, -1)
    k_nope, value = expanded.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    key = torch.cat([k_nope, k_pe[:, None].expand(-1, dims.num_heads, -1)], dim=-1)
    return attend_causal_varlen(query, key, value, plan, dims.scale)


def attend_causal_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: MixedPlan,
    scale: float,
) -> torch.Tensor:
    """Each prompt's query rows over its keys, causally with its last row at its last key:
    [Tq, H, D], [Sk, H, D], [Sk, H, Dv] -> [Tq, H, Dv]. In 16-bit on a GPU one flash call
    (values padded to the keys' width, which it needs); else a loop over the prompts."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn  # pulls in triton: CPU start-up

        width = value.shape[-1]
        value = F.pad(value, (0, key.shape[-1] - width))
        out = varlen_attn(
            query,
            key,
            value,
            plan.cu_q,
            plan.cu_k,
            plan.max_q,
            plan.max_k,
            scale=scale,
            window_size=(-1, 0),
        )
        return out[..., :width]
    out = query.new_empty(*query.shape[:2], value.shape[-1])
    spans = zip(itertools.pairwise(plan.cu_q_host), itertools.pairwise(plan.cu_k_host))
    for (q0, q1), (k0, k1) in spans:
        causal = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=query.device)
        out[q0:q1] = F.scaled_dot_product_attention(
            query[q0:q1].transpose(0, 1),
            key[k0:k1].transpose(0, 1),
            value[k0:k1].transpose(0, 1),
            attn_mask=causal.tril(k1 - k0 - (q1 - q0)),
            scale=scale,
        ).transpose(0, 1)
    return out


def fold_counters(meta: AttentionMetadata, query: torch.Tensor) -> torch.Tensor | None:
    """Zeros for the CUDA kernel's folded merge, enough for query's rows and heads, made once
    a step for every layer: each call leaves them zero, so only the step's first layer pays
    for the zeroing (a launch; about 2.5 us a call at 32-128 rows on the H200,
    mla_sweep_h200.json). None on CPU (the torch path merges nothing)."""
    if not query.is_cuda:
        return None
    rows, heads = query.shape[:2]
    return meta.once(
        ("mla_fold_counters", rows),
        lambda: torch.zeros(rows * heads, dtype=torch.int32, device=query.device),
    )


class MLAttention:
    """The attention of one MLA layer; the projections around it belong to the model."""

    def __init__(self, dims: MLADims, max_absorbed_rows: int = 0) -> None:
        self.dims = dims
        self.max_absorbed_rows = max_absorbed_rows

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_b_weight: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, H, nope + rope] -> [T, H, v], written into out when given."""
        if not (meta.is_pure_decode or query.shape[0] <= self.max_absorbed_rows):
            return self._mixed(query, kv_cache, meta, kv_b_weight, out)
        w_uk, w_uv = up_projections(kv_b_weight, self.dims)
        request, length = row_contexts(meta, query.shape[0])
        counters = fold_counters(meta, query)
        result = attend_absorbed(
            query, kv_cache, meta.block_tables, request, length, w_uk, w_uv, self.dims, counters
        )
        if out is None:
            return result
        out.copy_(result)
        return out

    def _mixed(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_b_weight: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The prompt chunks expanded in one call, the decode rows absorbed in another, both
        written into out's rows (padding rows zero)."""
        block_size = kv_cache.shape[2]
        plan = meta.once(
            ("mla_mixed_plan", query.shape[0]),
            lambda: mixed_plan(meta, query.shape[0], block_size),
        )
        if out is None:
            out = query.new_zeros(*query.shape[:2], self.dims.v_head_dim)
        else:
            out.zero_()
        latents = kv_cache[0, :, :, 0].flatten(0, 1)[plan.context_slots]
        prompts = attend_prompts(query[plan.prompt_rows], latents, kv_b_weight, plan, self.dims)
        out.index_copy_(0, plan.prompt_rows, prompts)
        if plan.decode_rows.numel():
            request, length = row_contexts(meta, query.shape[0])
            w_uk, w_uv = up_projections(kv_b_weight, self.dims)
            rows = plan.decode_rows
            decodes = attend_absorbed(
                query[rows],
                kv_cache,
                meta.block_tables,
                request[rows],
                length[rows],
                w_uk,
                w_uv,
                self.dims,
                fold_counters(meta, query),
            )
            out.index_copy_(0, rows, decodes)
        return out
