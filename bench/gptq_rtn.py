"""A 4-bit GPTQ checkpoint of a 16- or 32-bit one by round to nearest (no calibration data, so
none of GPTQ's error correction): every decoder projection's weight becomes AutoGPTQ's
qweight/qzeros/scales/g_idx, written from the format's documentation, independently of the
loader's unpacking code. The agreement bench (bench/quant_agreement_cpu.py) and the tests
(tests/test_quant_layers.py, tests/test_quant_model.py) use it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_int4(w: torch.Tensor, group: int, symmetric: bool):
    """Round-to-nearest 4-bit of W [K, N] in groups of K rows: (q, scales, zeros) with
    W ~ (q - zeros) * scales, q and zeros in 0..15."""
    k, n = w.shape
    g = w.reshape(k // group, group, n)
    if symmetric:
        scales = g.abs().amax(dim=1) / 7.5
        zeros = torch.full_like(scales, 8)
    else:
        lo, hi = g.amin(dim=1), g.amax(dim=1)
        scales = (hi - lo).clamp(min=1e-8) / 15
        zeros = (-lo / scales).round().clamp(0, 15)
    q = (g / scales[:, None] + zeros[:, None]).round().clamp(0, 15).reshape(k, n)
    return q.int(), scales, zeros.int()


def gptq_pack_rows(q: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qweight: row i of q in bits 4 * (i % 8) of word row i // 8."""
    shifts = (4 * torch.arange(8)).view(1, 8, 1)
    words = (q.long().view(q.shape[0] // 8, 8, q.shape[1]) << shifts).sum(dim=1)
    return as_int32(words)


def gptq_pack_cols(q: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qzeros: column j in bits 4 * (j % 8) of word column j // 8."""
    return gptq_pack_rows(q.t()).t().contiguous()


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """32-bit words held in int64 as the int32 of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_gptq(source: Path, target: Path, group: int) -> Path:
    """target: source's folder with every decoder projection as GPTQ 4-bit (asymmetric, groups
    of `group` input features, checkpoint_format gptq: zero points stored minus one)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEAR:
            tensors[name] = tensor
            continue
        q, scales, zeros = rtn_int4(tensor.float().t(), group, symmetric=False)
        base = name.removesuffix(".weight")
        tensors[f"{base}.qweight"] = gptq_pack_rows(q)
        tensors[f"{base}.qzeros"] = gptq_pack_cols(zeros - 1)
        tensors[f"{base}.scales"] = scales.half()
        tensors[f"{base}.g_idx"] = (torch.arange(q.shape[0]) // group).int()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": False,
        "sym": False,
    }
    (target / "config.json").write_text(json.dumps(config))
    return target
