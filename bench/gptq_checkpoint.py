"""A 4-bit GPTQ checkpoint of a 16- or 32-bit one: every decoder projection's weight becomes
AutoGPTQ's qweight/qzeros/scales/g_idx, written from the format's documentation, independently
of the loader's unpacking code. Rounded to nearest (rtn_int4), or by GPTQ's error correction
(Frantar et al., 2022: each column's rounding error spread over the columns not yet rounded,
weighted by the inverse Hessian of the layer's inputs on calibration text; gptq_int4). The
agreement bench (bench/quant_agreement_cpu.py) and the tests (tests/test_quant_layers.py,
tests/test_quant_model.py) use it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# calibration text that is not the agreement text: the standard library's module docstrings
# (technical English with code, as a README is)
CALIBRATION_MODULES = (
    "argparse", "asyncio", "collections", "csv", "dataclasses", "functools", "json", "logging",
    "pathlib", "subprocess", "textwrap", "typing", "unittest", "zipfile", "email", "http",
    "sqlite3", "heapq", "bisect", "contextlib", "threading", "decimal", "fractions",
    "statistics", "difflib", "string", "re", "datetime", "pickle", "shutil",
)  # fmt: skip


def group_params(g: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) of 4-bit groups g [..., group, N] over dim -2, zeros whole 0..15."""
    if symmetric:
        scales = g.abs().amax(dim=-2) / 7.5
        return scales, torch.full_like(scales, 8)
    lo, hi = g.amin(dim=-2), g.amax(dim=-2)
    scales = (hi - lo).clamp(min=1e-8) / 15
    return scales, (-lo / scales).round().clamp(0, 15)


def rtn_int4(w: torch.Tensor, group: int, symmetric: bool):
    """Round-to-nearest 4-bit of W [K, N] in groups of K rows: (q, scales, zeros) with
    W ~ (q - zeros) * scales, q and zeros in 0..15."""
    k, n = w.shape
    g = w.reshape(k // group, group, n)
    scales, zeros = group_params(g, symmetric)
    q = (g / scales[:, None] + zeros[:, None]).round().clamp(0, 15).reshape(k, n)
    return q.int(), scales, zeros.int()


def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group: int, block: int = 128):
    """GPTQ's 4-bit W [K, N] (asymmetric, groups of K rows), in rtn_int4's form: hessian
    [K, K] is the layer inputs' X^T X. Each group's scale and zero point come from its columns
    as the errors before them left them; 1% of the mean diagonal damps the Hessian."""
    k, n = w.shape
    assert block % group == 0 and k % group == 0
    w = w.t().float().clone()  # [N, K]: the rounding walks K
    h = hessian.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += 0.01 * h.diagonal().mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    hinv = hinv.float()
    q = torch.zeros(n, k, dtype=torch.int32)
    scales, zeros = torch.zeros(k // group, n), torch.zeros(k // group, n)
    for start in range(0, k, block):
        end = min(start + block, k)
        part, errors, h_part = (
            w[:, start:end].clone(),
            torch.zeros(n, end - start),
            hinv[start:end, start:end],
        )
        for i in range(end - start):
            column = start + i
            if column % group == 0:
                s, z = group_params(part[:, i : i + group].t(), symmetric=False)
                scales[column // group], zeros[column // group] = s, z
            s, z = scales[column // group], zeros[column // group]
            rounded = (part[:, i] / s + z).round().clamp(0, 15)
            error = (part[:, i] - (rounded - z) * s) / h_part[i, i]
            part[:, i:] -= error[:, None] * h_part[i, i:][None, :]
            errors[:, i] = error
            q[:, column] = rounded.int()
        w[:, end:] -= errors @ hinv[start:end, end:]
    return q.t().contiguous(), scales, zeros.int()


def calibration_hessians(model_dir: Path, tokens: int) -> dict[str, torch.Tensor]:
    """Each decoder projection's X^T X (by its weight's name) over `tokens` tokens of the
    calibration text, through the unquantized model (Hugging Face's, in fp32)."""
    text = "\n\n".join(
        inspect.getdoc(importlib.import_module(m)) or "" for m in CALIBRATION_MODULES
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tokenizer(text)["input_ids"][:tokens])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sums: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.t() @ x

        return hook

    hooks = [
        module.register_forward_pre_hook(record(f"{name}.weight"))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEAR
    ]
    try:
        with torch.inference_mode():
            model(ids[None])
    finally:
        for hook in hooks:
            hook.remove()
    return {name: s.float() for name, s in sums.items()}


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


def write_gptq(
    source: Path, target: Path, group: int, hessians: dict[str, torch.Tensor] | None = None
) -> Path:
    """target: source's folder with every decoder projection as GPTQ 4-bit (asymmetric, groups
    of `group` input features, checkpoint_format gptq: zero points stored minus one), by GPTQ
    with each weight's Hessian in hessians, else rounded to nearest."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEAR:
            tensors[name] = tensor
            continue
        if hessians is None:
            q, scales, zeros = rtn_int4(tensor.float().t(), group, symmetric=False)
        else:
            q, scales, zeros = gptq_int4(tensor.float().t(), hessians[name], group)
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
