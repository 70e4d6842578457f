"""Multi-head latent attention (DeepSeek-V2) over a paged cache of compressed latents.

Each token's cache entry is one vector per layer, not per head: its latent c (kv_lora_rank
entries, already normalised) followed by its rotated rope key (qk_rope_head_dim entries); the
cache is [1, num_blocks, block_size, 1, kv_lora_rank + rope_dim] (KVCacheSpec(1, 1, ...)).
The up-projection kv_b_proj [H * (nope + v), kv_lora_rank] turns c into each head's key
(W_UK) and value (W_UV).

Prompt chunks go through the up-projections: keys and values per head for the request's context,
then attention as usual. Decode absorbs them: q_nope @ W_UK is a query in latent space, scored
against the latents and rope keys as one shared head (MQA with head dim kv_lora_rank + rope_dim),
and the latent output goes through W_UV; each step reads only the latents (kernels.mla_decode
on CUDA). Steps of up to max_absorbed_rows rows (the backend's max_short_step_tokens, whose
steps CUDA graphs capture whole) take the absorbed path for every row: it reads no host metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels
from asyncllm.attention.backend import AttentionMetadata
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding

_PROMPT_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,  # where neither fused kernel takes the inputs
]


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
) -> torch.Tensor:
    """query [T, H, nope + rope] -> [T, H, v] through the latent space."""
    q_nope, q_pe = query.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
    q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)
    absorbed = torch.cat([q_latent, q_pe], dim=-1)
    attend = kernels.paged_mla_decode if query.is_cuda else attend_latent_torch
    out_latent = attend(
        absorbed, kv_cache, block_tables, request, length, dims.scale, dims.kv_lora_rank
    )
    # per head into [T, H, v] directly (cuBLAS writes the strided rows): o_proj reads it flat,
    # where the einsum's [H, T, v] layout cost a copy a layer at every batch above 1
    out = out_latent.new_empty(*out_latent.shape[:2], dims.v_head_dim)
    torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out


def attend_expanded(
    query: torch.Tensor,
    latents: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    dims: MLADims,
) -> torch.Tensor:
    """One request's prompt rows [Q, H, nope + rope] over its whole context's latents
    [S, rank + rope], keys and values expanded per head -> [Q, H, v]. SDPA's flash kernel takes
    it on a GPU within sdpa_kernel(_PROMPT_BACKENDS): batched 4-D inputs, the values padded to
    the keys' width and the causal mask aligned to the last row without being materialised;
    cuDNN's is left out, as it plans each new shape on the host (seconds over a workload's
    prompt lengths). Before, SDPA's math path in fp32 took half the GPU time of
    DeepSeek-V2-Lite's prompts (bench/NOTES.md)."""
    c, k_pe = latents.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
    k_nope = torch.einsum("sl,hdl->hsd", c, w_uk)
    value = torch.einsum("sl,hdl->hsd", c, w_uv)
    key = torch.cat([k_nope, k_pe[None].expand(dims.num_heads, -1, -1)], dim=-1)
    value = F.pad(value, (0, key.shape[-1] - dims.v_head_dim))
    # imported here: the module pulls in triton and sympy, which the CPU server's start-up
    # leaves out (tests/test_startup.py)
    from torch.nn.attention.bias import causal_lower_right

    causal = causal_lower_right(query.shape[0], latents.shape[0])
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key[None], value[None], attn_mask=causal, scale=dims.scale
    )
    return out[0, ..., : dims.v_head_dim].transpose(0, 1)


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
        w_uk, w_uv = up_projections(kv_b_weight, self.dims)
        if meta.is_pure_decode or query.shape[0] <= self.max_absorbed_rows:
            request, length = row_contexts(meta, query.shape[0])
            result = attend_absorbed(
                query, kv_cache, meta.block_tables, request, length, w_uk, w_uv, self.dims
            )
        else:
            result = self._mixed(query, kv_cache, meta, w_uk, w_uv)
        if out is None:
            return result
        out.copy_(result)
        return out

    def _mixed(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """Prompt chunks expanded one request at a time, each run of consecutive decode rows
        absorbed in one call; slices only, so nothing waits on a host-to-device copy."""
        out = query.new_zeros(*query.shape[:2], self.dims.v_head_dim)  # padding rows too
        runs = meta.once("mla_mixed_runs", lambda: mixed_runs(meta.query_lens_cpu))
        block_size = kv_cache.shape[2]
        with sdpa_kernel(_PROMPT_BACKENDS):  # once a layer: about 13 us a call
            for run in runs:
                rows = slice(run.first_row, run.first_row + run.num_rows)
                if run.decodes:
                    request, length = row_contexts(meta, query.shape[0])
                    out[rows] = attend_absorbed(
                        query[rows],
                        kv_cache,
                        meta.block_tables,
                        request[rows],
                        length[rows],
                        w_uk,
                        w_uv,
                        self.dims,
                    )
                    continue
                seq_len = meta.seq_lens_cpu[run.request]
                table = meta.block_tables[run.request, : -(-seq_len // block_size)].long()
                latents = kv_cache[0, :, :, 0][table].flatten(0, 1)[:seq_len]
                out[rows] = attend_expanded(query[rows], latents, w_uk, w_uv, self.dims)
        return out


@dataclass(frozen=True)
class MixedRun:
    """Rows of a mixed step that attend in one call: one request's prompt chunk, or
    consecutive requests' decode rows."""

    first_row: int
    num_rows: int
    decodes: bool
    request: int  # the prompt chunk's request (for decodes: the first one's)


def mixed_runs(query_lens: list[int]) -> list[MixedRun]:
    """The step's requests as runs: each prompt chunk alone, neighbouring decodes together;
    requests of no tokens (padding) in none."""
    runs: list[MixedRun] = []
    row = 0
    for request, query_len in enumerate(query_lens):
        decode = query_len == 1
        last = runs[-1] if runs else None
        if decode and last is not None and last.decodes and last.first_row + last.num_rows == row:
            runs[-1] = MixedRun(last.first_row, last.num_rows + 1, True, last.request)
        elif query_len:
            runs.append(MixedRun(row, query_len, decode, request))
        row += query_len
    return runs
