"""Tensor parallelism on CPU (gloo): a model split over ranks computes what it computes whole,
each rank reading only its shard of the checkpoint."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.multiprocessing
import transformers
from test_model_vs_hf import TINY as TINY_HF
from test_model_vs_hf import kv_caches, metadata

from asyncllm import LLM, SamplingParams
from asyncllm.attention.torch_backend import TorchAttentionBackend
from asyncllm.distributed.parallel_state import (
    DistributedInit,
    destroy_distributed,
    init_distributed,
)
from asyncllm.executor.multiproc import free_port
from asyncllm.layers.linear import process_weights_after_loading
from asyncllm.layers.quantization.base import native_bf16, onednn_bf16
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.loader import iter_safetensors
from kernels.cpu_gemm import cpu_gemm_available

TINY = {
    **TINY_HF,
    "vocab_size": 389,  # not a multiple of 2: the last rank's vocabulary shard is padded
    "num_attention_heads": 4,
    "initializer_range": 0.2,  # logits far enough apart for greedy ids to vary
}
CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False, attention_bias=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True)),
}


def save_random_model(name: str, folder: Path) -> Path:
    config_class, extra = CONFIGS[name]
    config = config_class(**TINY, **extra)
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: save_random_model(name, tmp_path_factory.mktemp(name)) for name in CONFIGS}


@torch.inference_mode()
def chunked_logits(path: Path, device: str = "cpu") -> torch.Tensor:
    """This rank's model over two requests: a prefill chunk, its continuation beside a decode
    row, then a batched decode; the logits of every row."""
    config = transformers.AutoConfig.from_pretrained(path)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, config.vocab_size, (23,), generator=gen)
    b = torch.randint(0, config.vocab_size, (9,), generator=gen)
    steps = [
        ([(0, 10), (0, 8)], torch.cat([a[:10], b[:8]]), [*range(10), *range(8)]),
        ([(10, 13), (8, 1)], torch.cat([a[10:], b[8:]]), [*range(10, 23), 8]),
        ([(23, 1), (9, 1)], torch.tensor([7, 3]), [23, 9]),
    ]
    with torch.device(device):
        model = LlamaForCausalLM(config, TorchAttentionBackend()).eval()
        model.load_weights(iter_safetensors(path))
        process_weights_after_loading(model)
        tables, caches = [[5, 2, 9, 11, 3, 7], [1, 8, 4]], kv_caches(model)
        logits = []
        for spans, ids, positions in steps:
            meta = metadata(spans, tables)
            hidden = model(ids.to(device), torch.tensor(positions), caches, meta)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits).cpu()


def rank_logits(
    rank: int, world_size: int, port: int, dirs: dict, out: Path, device: str = "cpu"
) -> None:
    """One rank of chunked_logits for each model (rank 0 saves them); on CUDA, GPU `rank`."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    init_distributed(DistributedInit(world_size, rank, f"tcp://127.0.0.1:{port}", backend))
    try:
        for name, path in dirs.items():
            logits = chunked_logits(path, device)
            if rank == 0:
                torch.save(logits, out / f"{name}.pt")
    finally:
        destroy_distributed()


def test_two_ranks_compute_the_logits_of_one(model_dirs, tmp_path) -> None:
    torch.multiprocessing.spawn(
        rank_logits, (2, free_port(), model_dirs, tmp_path), nprocs=2, join=True
    )
    for name, path in model_dirs.items():
        expected = chunked_logits(path)
        split = torch.load(tmp_path / f"{name}.pt")
        assert split.shape == expected.shape == (10 + 8 + 13 + 1 + 2, TINY["vocab_size"])
        error = (split - expected).norm() / expected.norm()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"


def greedy_engine(path: Path, **kwargs) -> tuple[list[list[int]], LLM]:
    """A schedule of chunked prefills, prefix hits and preemptions: 6 requests of a shared
    32-token prefix in a cache too small for all at once, half with a repetition penalty."""
    llm = LLM(
        model=str(path),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        block_size=8,
        num_kv_blocks=12,
        **kwargs,
    )
    prefix = list(range(3, 35))
    prompts = [{"prompt_token_ids": prefix + list(range(40 + i, 45 + 3 * i))} for i in range(6)]
    # a penalty reads the prompt and the outputs so far when the request first samples (again
    # after a preemption)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=penalty)
        for penalty in (1.0, 1.8) * 3
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("name, async_scheduling", [("llama", True), ("qwen3", False)])
def test_two_ranks_give_the_greedy_ids_of_one(model_dirs, name, async_scheduling) -> None:
    expected, llm = greedy_engine(model_dirs[name])
    stats = llm.latest_stats
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    assert len({tuple(ids) for ids in expected}) > 1
    split, llm = greedy_engine(
        model_dirs[name], tensor_parallel_size=2, async_scheduling=async_scheduling
    )
    pids = llm.core_client.core.executor.worker_pids
    llm.core_client.shutdown()
    assert split == expected
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


@pytest.mark.skipif(
    native_bf16() or not cpu_gemm_available(),
    reason="the bf16 mode runs on the CPU GEMM where the CPU has AVX2 but no bf16 dot products",
)
def test_two_ranks_give_the_greedy_ids_of_one_in_the_bf16_mode(model_dirs) -> None:
    """--dtype bfloat16 on the CPU GEMM: its bf16 panels split over the ranks (gate/up's halves
    of 48 columns then not whole panels, so not fused with the SiLU-and-mul), and the lm_head,
    whose 389 logits (195 a rank) are not whole panels, in oneDNN's layout (float32 where
    oneDNN has no bf16 GEMM)."""
    expected, llm = greedy_engine(model_dirs["llama"], dtype="bfloat16")
    model = llm.core_client.core.executor.model_runner.model
    gate_up = model.layers[0].mlp.gate_up_proj
    assert gate_up.cpu_gemm_packed and gate_up.weight.dtype == torch.bfloat16
    head_dtype = torch.bfloat16 if onednn_bf16() else torch.float32
    assert model.lm_head.onednn_packed and model.lm_head.weight.dtype == head_dtype
    llm.core_client.shutdown()
    split, llm = greedy_engine(model_dirs["llama"], dtype="bfloat16", tensor_parallel_size=2)
    llm.core_client.shutdown()
    assert split == expected


@pytest.mark.slow
def test_three_ranks_give_the_default_models_greedy_text() -> None:
    """SmolLM2-135M has 9 query and 3 KV heads: one KV head per rank at TP=3."""
    from test_engine_matches_hf import NEW_TOKENS, PROMPTS

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    texts = {}
    for tp in (1, 3):
        llm = LLM(tensor_parallel_size=tp, max_num_batched_tokens=256, max_num_seqs=8)
        outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
        texts[tp] = [o.outputs[0].text for o in outputs]
        llm.core_client.shutdown()
    assert texts[3] == texts[1]
