"""The paged MLA decode kernel and the latent cache write against the torch reference.

On CPU under TRITON_INTERPRET=1 (conftest.py) at tiny sizes; with a GPU in bf16 too, at
DeepSeek-V2-Lite's widths."""

from __future__ import annotations

import pytest
import torch
from test_model_vs_hf import metadata

import kernels
from asyncllm.attention.mla import attend_latent_torch, row_contexts, write_latent_cache
from kernels.mla_decode import choose_mla_splits, paged_mla_decode

FULL = torch.cuda.is_available()
DEVICE = "cuda" if FULL else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if FULL else [torch.float32]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (heads, kv_lora_rank, rope): heads below the 16-row tile, rank and rope not powers of two
DIMS = (16, 512, 64) if FULL else (5, 40, 12)
BLOCK_SIZE = 4
NUM_BLOCKS = 40


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def latent_cache(dtype: torch.dtype) -> torch.Tensor:
    _, rank, rope = DIMS
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shape = (1, NUM_BLOCKS, BLOCK_SIZE, 1, rank + rope)
    return torch.randn(shape, generator=gen, device=DEVICE).to(dtype)


# None: the split count chosen from the shapes; 64: more splits than the contexts have tiles
@pytest.mark.parametrize("num_splits", [1, 3, 64, None])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_matches_torch(dtype: torch.dtype, num_splits: int) -> None:
    heads, rank, rope = DIMS
    # one position, a part block, more than the kernel's tile, a padding row (length 0)
    lengths = [1, 3, 37, 0, 21]
    tables = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))
    tables = tables[:30].view(3, 10).to(torch.int32).to(DEVICE)
    request = torch.tensor([0, 1, 2, 2, 1], dtype=torch.int32, device=DEVICE)
    length = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(lengths), heads, rank + rope, device=DEVICE).to(dtype)
    cache = latent_cache(dtype)
    scale = (rank + rope) ** -0.5
    out = paged_mla_decode(query, cache, tables, request, length, scale, rank, num_splits)
    ref = attend_latent_torch(query, cache, tables, request, length, scale, rank)
    assert out.shape == (len(lengths), heads, rank)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_latent_cache_write_skips_padding() -> None:
    width = sum(DIMS[1:])
    latent = torch.randn(4, width, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 17], device=DEVICE)
    ours, ref = latent_cache(torch.float32), latent_cache(torch.float32).cpu()
    kernels.write_latent_cache(latent, ours, slots)
    write_latent_cache(latent.cpu(), ref, slots.cpu())  # the torch path
    assert torch.equal(ours.cpu(), ref)
    assert torch.equal(ref[0].view(-1, width)[[5, 0, 17]], latent.cpu()[[0, 2, 3]])


def test_row_contexts_are_causal_per_request() -> None:
    meta = metadata([(4, 3), (9, 1)], [[0, 1], [2, 3, 4]])
    request, length = row_contexts(meta, 6)  # two padding rows past the 4 real ones
    assert request.tolist()[:4] == [0, 0, 0, 1]
    assert length.tolist() == [5, 6, 7, 10, 0, 0]


def test_splits_fill_the_gpu_at_small_batch_and_keep_long_splits() -> None:
    cpu = torch.device("cpu")  # 8 "SMs" here
    assert choose_mla_splits(1, 1, 4096, cpu) == 32  # four programs per SM
    assert choose_mla_splits(1, 1, 256, cpu) == 2  # no split under 128 tokens
    assert choose_mla_splits(4, 1, 4096, cpu) == 8
    assert choose_mla_splits(8, 1, 4096, cpu) == 1  # a program per SM already
