"""Tensor parallelism on two GPUs (NCCL, issue 21): the logits of one GPU in fp32, its greedy
ids in bf16 over the first tokens, CUDA graphs bit for bit, the Ray executor as the worker
processes. Models: the Qwen3-0.6B and Llama-3.2-1B shapes, two layers, random weights."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing
import transformers
from test_tensor_parallel import chunked_logits, rank_logits

from asyncllm import LLM, SamplingParams
from asyncllm.executor.multiproc import free_port
from asyncllm.models.shapes import SHAPES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

NAMES = ("qwen3-0.6b", "llama-3.2-1b")
KV_CACHE_BYTES = 1 << 30


@pytest.fixture(scope="module")
def shape_dirs(tmp_path_factory) -> dict:
    dirs = {}
    for name in NAMES:
        fields = {**SHAPES[name], "num_hidden_layers": 2, "max_position_embeddings": 4096}
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        torch.manual_seed(0)
        dirs[name] = tmp_path_factory.mktemp(name)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(dirs[name])
    return dirs


def test_two_gpus_compute_the_fp32_logits_of_one(shape_dirs, tmp_path) -> None:
    torch.multiprocessing.spawn(
        rank_logits, (2, free_port(), shape_dirs, tmp_path, "cuda"), nprocs=2, join=True
    )
    for name, path in shape_dirs.items():
        expected = chunked_logits(path, "cuda")
        error = (torch.load(tmp_path / f"{name}.pt") - expected).norm() / expected.norm()
        assert error <= 1e-5, f"{name}: relative error {error:.2e}"


def generate(path, **kwargs) -> list[tuple]:
    llm = LLM(model=str(path), kv_cache_memory=KV_CACHE_BYTES, max_model_len=2048, **kwargs)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 30000, (k,), generator=gen).tolist()}
        for k in (1, 17, 100, 300, 700)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.core_client.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def token_ids(results: list[tuple]) -> list[list[int]]:
    return [ids for ids, _ in results]


@pytest.mark.parametrize("name", NAMES)
def test_two_gpus_give_the_bf16_greedy_ids_of_one(shape_dirs, name) -> None:
    one = generate(shape_dirs[name])
    two = generate(shape_dirs[name], tensor_parallel_size=2)
    assert token_ids(two) == token_ids(one)


def test_cuda_graphs_at_two_gpus_match_eager_bit_for_bit(shape_dirs) -> None:
    path = shape_dirs["qwen3-0.6b"]
    eager = generate(path, tensor_parallel_size=2, enforce_eager=True)
    assert generate(path, tensor_parallel_size=2) == eager


def test_ray_workers_give_what_the_worker_processes_give(shape_dirs) -> None:
    pytest.importorskip("ray")
    path = shape_dirs["llama-3.2-1b"]
    processes = generate(path, tensor_parallel_size=2)
    assert generate(path, tensor_parallel_size=2, distributed_executor_backend="ray") == processes
