"""An FP8 checkpoint's KV cache scales: loaded per layer from each name vLLM reads, used by the
FP8 cache (the torch backend, and the Triton kernels on the GPU or under TRITON_INTERPRET),
replicated on every tensor-parallel rank; checked at load.

The checkpoints are a tiny random HF Llama with the scale tensors added to its safetensors; the
compressed-tensors one carries the library's own kv_cache_scheme (QuantizationArgs) over its
FP8_DYNAMIC weights and the scales named as the library names them (KVCacheScaleType): its
apply_quantization_config finds no attention module to hook in transformers 5 (LlamaAttention's
forward takes `cache`, not the `past_key_values` it looks for), so the tensors are added here.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing
from compressed_tensors.quantization import KVCacheScaleType, QuantizationArgs
from safetensors.torch import load_file, save_file
from test_kernels_attention import DEVICE
from test_kernels_qkv_prep import on_device
from test_model_vs_hf import metadata
from test_quant_checkpoints import CONFIG, tiny_llama, write_compressed

from asyncllm.attention.torch_backend import TorchAttentionBackend
from asyncllm.attention.triton_backend import TritonAttentionBackend
from asyncllm.config import EngineArgs, ModelConfig
from asyncllm.distributed.parallel_state import (
    DistributedInit,
    destroy_distributed,
    init_distributed,
)
from asyncllm.executor.multiproc import free_port
from asyncllm.models.llama import Attention
from asyncllm.models.loader import load_model

FP8 = torch.float8_e4m3fn
LAYERS = CONFIG["num_hidden_layers"]
# checkpoint name (under model.layers.N.self_attn) of the keys' and the values' scale
NAME_STYLES = {
    "vllm": ("k_scale", "v_scale"),
    "modelopt": ("k_proj.k_scale", "v_proj.v_scale"),
    "compressed-tensors-output-scale": ("k_proj.output_scale", "v_proj.output_scale"),
}
IDS = torch.randint(0, CONFIG["vocab_size"], (21,), generator=torch.Generator().manual_seed(4))


def layer_scales(layer: int) -> tuple[float, float]:
    """Distinct per layer and per plane, far from 1, and exact in fp32."""
    return 0.25 * (layer + 2), 2.0 ** -(layer + 6)


def add_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    file = path / "model.safetensors"
    save_file({**load_file(file), **tensors}, file, metadata={"format": "pt"})


def scale_tensors(names: tuple[str, str], scales: list[tuple[float, float]]) -> dict:
    """A scalar fp32 tensor per layer and plane, as FP8 checkpoints store them."""
    tensors = {}
    for layer, pair in enumerate(scales):
        for name, value in zip(names, pair):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(value)
    return tensors


def as_stored(scales: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The scales as their fp32 tensors hold them."""
    return [(torch.tensor(k).item(), torch.tensor(v).item()) for k, v in scales]


def save_tiny(path: Path, kv_gain: float = 1.0) -> Path:
    """tiny_llama() with keys and values kv_gain times larger, and the same outputs: q_proj and
    o_proj shrink by as much (the attention scores q . k and o_proj(v) are unchanged)."""
    model = tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight *= kv_gain
            attn.v_proj.weight *= kv_gain
            attn.q_proj.weight /= kv_gain
            attn.o_proj.weight /= kv_gain
    model.save_pretrained(path)
    return path


def load(path: Path, kv_cache_dtype: str = "fp8", backend: str = "torch") -> torch.nn.Module:
    """On CPU; with the Triton backend on the GPU where there is one (else the interpreter)."""
    device = DEVICE if backend == "triton" else "cpu"
    args = EngineArgs(
        model=str(path), device=device, dtype="float32", kv_cache_dtype=kv_cache_dtype
    )
    attention = TritonAttentionBackend() if backend == "triton" else TorchAttentionBackend()
    return load_model(ModelConfig.from_args(args), attention)


def loaded_scales(model: torch.nn.Module) -> list[tuple[float, float] | None]:
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    return [None if a.kv_scales is None else (a.kv_scales.k, a.kv_scales.v) for a in attentions]


@pytest.mark.parametrize("style", NAME_STYLES)
def test_each_layer_loads_its_own_scales(style, tmp_path: Path) -> None:
    scales = [layer_scales(i) for i in range(LAYERS)]
    add_tensors(save_tiny(tmp_path), scale_tensors(NAME_STYLES[style], scales))
    assert loaded_scales(load(tmp_path)) == scales


def test_the_older_kv_scale_sets_both(tmp_path: Path) -> None:
    add_tensors(save_tiny(tmp_path), scale_tensors(("kv_scale",), [(0.5,), (2.0,)]))
    assert loaded_scales(load(tmp_path)) == [(0.5, 0.5), (2.0, 2.0)]


def test_a_compressed_tensors_kv_cache_scheme_loads(tmp_path: Path) -> None:
    write_compressed("FP8_DYNAMIC", tmp_path)
    scheme = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
    edit_quantization_config(tmp_path, lambda q: q.update(kv_cache_scheme=scheme.model_dump()))
    names = (KVCacheScaleType.KEY.value, KVCacheScaleType.VALUE.value)
    scales = [layer_scales(i) for i in range(LAYERS)]
    add_tensors(tmp_path, scale_tensors(names, scales))
    assert loaded_scales(load(tmp_path)) == scales


def edit_quantization_config(path: Path, edit) -> None:
    file = path / "config.json"
    config = json.loads(file.read_text())
    config.setdefault("quantization_config", {"quant_method": "compressed-tensors"})
    edit(config["quantization_config"])
    file.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("type", "int", r"kv_cache_scheme\.type is 'int'"),
        ("num_bits", 4, r"kv_cache_scheme\.num_bits is 4"),
        ("strategy", "attn_head", r"kv_cache_scheme\.strategy is 'attn_head'"),
    ],
)
def test_an_fp8_cache_refuses_another_kv_cache_scheme(field, value, message, tmp_path) -> None:
    write_compressed("FP8_DYNAMIC", tmp_path)
    scheme = QuantizationArgs(num_bits=8, type="float", strategy="tensor").model_dump()
    edit_quantization_config(tmp_path, lambda q: q.update(kv_cache_scheme={**scheme, field: value}))
    with pytest.raises(ValueError, match=message):
        load(tmp_path)
    load(tmp_path, kv_cache_dtype="auto")  # a cache of the model's dtype uses no scheme


def test_a_scale_of_the_wrong_shape_or_sign_fails_naming_it(tmp_path: Path) -> None:
    save_tiny(tmp_path)
    name = "model.layers.1.self_attn.k_scale"
    add_tensors(tmp_path, {name: torch.tensor([0.5, 0.5])})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_scale.*per tensor.*\(2,\)"):
        load(tmp_path)
    add_tensors(tmp_path, {name: torch.tensor(-1.0)})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_scale.*> 0"):
        load(tmp_path)


def test_without_scales_an_fp8_cache_warns_once(tmp_path: Path, caplog) -> None:
    save_tiny(tmp_path)
    with caplog.at_level(logging.WARNING, logger="asyncllm.models.loader"):
        assert loaded_scales(load(tmp_path)) == [None] * LAYERS
        warnings = [r for r in caplog.records if "KV cache scales" in r.message]
        assert len(warnings) == 1 and "2 of 2 attention layers" in warnings[0].message
        caplog.clear()
        load(tmp_path, kv_cache_dtype="auto")
        add_tensors(tmp_path, scale_tensors(NAME_STYLES["vllm"], [(1.0, 1.0)] * LAYERS))
        load(tmp_path)
    assert not [r for r in caplog.records if "KV cache scales" in r.message]


@torch.inference_mode()
def logits(model: torch.nn.Module, cache_dtype: torch.dtype) -> torch.Tensor:
    """A prefill of IDS[:-5] then five decode steps, over caches of cache_dtype."""
    device = model.embed_tokens.weight.device
    blocks, block_size = 8, 4
    caches = [
        torch.zeros(s.shape(blocks, block_size), dtype=cache_dtype, device=device)
        for s in model.kv_cache_specs
    ]
    table, n = [[3, 0, 6, 1, 7, 2, 5, 4]], len(IDS) - 5
    steps = [(IDS[:n], range(n), [(0, n)])]
    steps += [(IDS[p : p + 1], [p], [(p, 1)]) for p in range(n, len(IDS))]
    rows = []
    for ids, positions, spans in steps:
        meta = on_device(metadata(spans, table)) if device.type != "cpu" else metadata(spans, table)
        rows.append(model(ids.to(device), torch.tensor(positions, device=device), caches, meta))
    return model.compute_logits(torch.cat(rows)).cpu()


def kv_amax(model: torch.nn.Module) -> list[tuple[float, float]]:
    """Each layer's largest |key| (rotated) and |value| over the run, read from fp32 caches."""
    blocks, block_size = 8, 4
    caches = [torch.zeros(s.shape(blocks, block_size)) for s in model.kv_cache_specs]
    with torch.inference_mode():
        model(IDS, torch.arange(len(IDS)), caches, metadata([(0, len(IDS))], [list(range(8))]))
    return [(c[0].abs().max().item(), c[1].abs().max().item()) for c in caches]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_checkpoints_scales_keep_large_keys_from_saturating(backend, tmp_path: Path) -> None:
    """Keys and values in the thousands: an FP8 cache of scale 1.0 saturates them at 448 and the
    logits drift; with the checkpoint's scales (amax / 448) they stay close to the fp32
    cache's."""
    save_tiny(tmp_path, kv_gain=3000.0)
    amax = kv_amax(load(tmp_path, kv_cache_dtype="auto"))
    assert min(k for k, _ in amax) > 2000 and min(v for _, v in amax) > 448
    exact = logits(load(tmp_path, kv_cache_dtype="auto"), torch.float32)
    unscaled = logits(load(tmp_path, backend=backend), FP8)
    scales = [(k / 448, v / 448) for k, v in amax]
    add_tensors(tmp_path, scale_tensors(NAME_STYLES["vllm"], scales))
    scaled_model = load(tmp_path, backend=backend)
    assert loaded_scales(scaled_model) == as_stored(scales)
    scaled = logits(scaled_model, FP8)

    def error(x: torch.Tensor) -> float:
        return ((x - exact).norm() / exact.norm()).item()

    assert error(scaled) < 0.06, error(scaled)
    assert error(scaled) < error(unscaled) / 10, (error(scaled), error(unscaled))


def rank_scales_and_logits(rank: int, world_size: int, port: int, path: Path, out: Path) -> None:
    init_distributed(DistributedInit(world_size, rank, f"tcp://127.0.0.1:{port}", "gloo"))
    try:
        model = load(path)
        kv_heads = [m.num_kv_heads for m in model.modules() if isinstance(m, Attention)]
        torch.save((loaded_scales(model), kv_heads, logits(model, FP8)), out / f"rank{rank}.pt")
    finally:
        destroy_distributed()


def test_each_tensor_parallel_rank_holds_every_layers_scales(tmp_path: Path) -> None:
    """Per layer, not per head: both ranks (one KV head each) hold the checkpoint's numbers,
    and their FP8 cache halves compute the logits of one rank."""
    path = save_tiny(tmp_path / "model", kv_gain=3000.0)
    scales = [(k / 448, v / 448) for k, v in kv_amax(load(path, kv_cache_dtype="auto"))]
    add_tensors(path, scale_tensors(NAME_STYLES["vllm"], scales))
    torch.multiprocessing.spawn(
        rank_scales_and_logits, (2, free_port(), path, tmp_path), nprocs=2, join=True
    )
    expected = logits(load(path), FP8)
    for rank in range(2):
        rank_scales, kv_heads, rank_logits = torch.load(tmp_path / f"rank{rank}.pt")
        assert rank_scales == as_stored(scales) and kv_heads == [1] * LAYERS
    error = (rank_logits - expected).norm() / expected.norm()
    assert error < 1e-4, error


def test_an_engine_runs_with_the_checkpoints_scales(tmp_path: Path, tiny_model_dir: Path) -> None:
    """--kv-cache-dtype fp8 reaches the loader through the engine's config."""
    from asyncllm import LLM, SamplingParams

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    add_tensors(path, scale_tensors(NAME_STYLES["vllm"], [(0.5, 0.25)] * LAYERS))
    llm = LLM(model=str(path), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64)
    runner = llm.core_client.core.executor.model_runner
    assert loaded_scales(runner.model) == [(0.5, 0.25)] * LAYERS
    assert runner.kv_caches[0].dtype == FP8
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4
