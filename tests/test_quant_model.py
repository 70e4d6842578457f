"""The real default model (SmolLM2-135M-Instruct) quantized from its own weights: FP8 at load
(--quantization fp8) and 4-bit (a GPTQ checkpoint written here by round-to-nearest,
asymmetric, groups of 32, bench/gptq_checkpoint.py), each against the unquantized model: the
share of positions of real text (this project's README as it was, kept in tests/data) whose
top-1 next token agrees, and the README's question answered with "Paris".

Measured on that file (model-level here and through the engine's prompt logprobs in
bench/results/quant_agreement_*_cpu.json, the same figures): FP8 91.0% (the issue asks 95%;
the 93.0% first measured was on the README's text of the day, before it was kept in
tests/data); on this 135M model weight-only FP8 gives 93.0%, activation-only 94.3%, bf16 itself
98.7% against fp32, and 11 of the 27 positions FP8 changes are near ties (the top two within
0.15 nats). 4-bit 70.6% (round-to-nearest; GPTQ's error correction gives 67.9%: the weights
are already 4-bit, the GGUF's Q4_1 in blocks of 32 along K, which rounding in the same blocks
keeps up to a shift of under half a step); int8 W8A8 on CPU (--quantization int8, lm_head
included) 79.0% on an AVX2 EPYC, 77.0% on a Zen 5 with AVX-512 (the issue asks 98%: per-channel int8 weights alone give 96.7%, int8
activations per row alone 90-91%, fbgemm's 7-bit ones 87.7%). The int8 figure is chaotic in
the attention's last bits: rounding each layer's input to int8 turns fp32 differences of 1e-6
into logits up to 11 apart, so on one Zen 4 the same model gave 74.0% with the C++ prompt
attention, 76.0% with SDPA and 78.3% with float64 attention (bench/NOTES.md, session 42), the
C++ kernel being the closer of the two fp32 ones to float64; --dtype bfloat16 on CPU (bf16
weights and KV cache under float32 activations) 98.0-98.7% by the same last bits with its
lm_head's logits as they came, 100% through the engine since its top logits are refined in
float32 (bench/results/quant_agreement_bf16_refined_cpu.json, the issue's 98%). The bounds sit
a little under the measurements, so a regression shows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_quant_checkpoints import load_ours, our_logits

from asyncllm import LLM, SamplingParams
from asyncllm.layers.quantization import cpu_bf16
from bench.gptq_checkpoint import write_gptq
from kernels.cpu_gemm import cpu_gemm_available

TEXT = Path(__file__).resolve().parent / "data" / "quant_agreement_text.md"
POSITIONS = 300
GROUP = 32


BF16_MODE = pytest.mark.skipif(
    not (cpu_bf16.onednn_bf16() or cpu_gemm_available()),
    reason="neither oneDNN's bf16 GEMM nor the CPU GEMM (AVX2 and FMA) runs on this CPU",
)
NATIVE_BF16 = pytest.mark.skipif(
    not cpu_bf16.native_bf16(),
    reason="oneDNN runs the bf16 mode where the CPU has bf16 dot products",
)


@pytest.fixture(scope="module")
def text_ids(default_model_dir: Path) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    return torch.tensor(tokenizer(TEXT.read_text())["input_ids"][:POSITIONS])


@pytest.fixture(scope="module")
def reference_top1(default_model_dir: Path, text_ids: torch.Tensor) -> torch.Tensor:
    return our_logits(load_ours(default_model_dir), text_ids).argmax(-1)


def agreement(model: torch.nn.Module, ids: torch.Tensor, reference: torch.Tensor) -> float:
    return (our_logits(model, ids).argmax(-1) == reference).float().mean().item()


def test_fp8_at_load_agrees_with_the_unquantized_model(
    default_model_dir, text_ids, reference_top1
) -> None:
    share = agreement(load_ours(default_model_dir, "fp8"), text_ids, reference_top1)
    print(f"FP8 top-1 agreement over {len(text_ids)} positions: {share:.1%}")
    assert share >= 0.90


def test_int8_at_load_agrees_with_the_unquantized_model(
    default_model_dir, text_ids, reference_top1
) -> None:
    model = load_ours(default_model_dir, "int8")
    # the tied lm_head has its own int8 copy; the embedding keeps its dense rows
    assert hasattr(model.lm_head, "int8_packed") and not hasattr(model.lm_head, "weight")
    assert model.embed_tokens.weight.dtype == torch.float32
    share = agreement(model, text_ids, reference_top1)
    print(f"int8 top-1 agreement over {len(text_ids)} positions: {share:.1%}")
    assert share >= 0.72


@BF16_MODE
def test_bfloat16_on_cpu_agrees_with_float32(default_model_dir, text_ids, reference_top1) -> None:
    """--dtype bfloat16 on CPU: bf16 weights (the tied lm_head's own packed copy too) and KV
    cache, float32 activations and logits; in oneDNN's layout where the CPU has bf16 dot
    products, else in the CPU GEMM's panels."""
    model = load_ours(default_model_dir, dtype="bfloat16")
    layout = "onednn_packed" if cpu_bf16.native_bf16() else "cpu_gemm_packed"
    assert model.lm_head.weight.dtype == torch.bfloat16 and getattr(model.lm_head, layout)
    assert getattr(model.layers[0].mlp.gate_up_proj, layout)
    # its top logits are refined from the tied embedding's float32 rows, not a copy
    assert model.lm_head.float32_weight is model.embed_tokens.weight
    assert model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == model.norm.weight.dtype == torch.float32
    logits = our_logits(model, text_ids, torch.bfloat16)
    assert logits.dtype == torch.float32
    share = (logits.argmax(-1) == reference_top1).float().mean().item()
    print(f"bf16 weights and KV cache: top-1 agreement over {len(text_ids)} positions: {share:.1%}")
    assert share >= 0.99


@NATIVE_BF16
def test_bfloat16_on_cpu_keeps_o_proj_and_down_outputs_in_bf16_with_equal_logits(
    default_model_dir, text_ids
) -> None:
    """o_proj's and down_proj's bf16 GEMM outputs go into the fused add-norms as they are,
    whose bf16 outputs are the next GEMM's input: the same logits, bit for bit, as with each
    output widened to float32 and the norm's output rounded to bf16 by the next GEMM."""
    model = load_ours(default_model_dir, dtype="bfloat16")
    ids = text_ids[:48]
    outputs = []
    hook = model.layers[3].self_attn.o_proj.register_forward_hook(
        lambda module, args, out: outputs.append(out.dtype)
    )
    kept = our_logits(model, ids, torch.bfloat16)
    linears = [m for layer in model.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    assert all(linear.keeps_weight_dtype for linear in linears)
    for linear in linears:
        linear.keeps_weight_dtype = False
    widened = our_logits(model, ids, torch.bfloat16)
    hook.remove()
    assert outputs == [torch.bfloat16, torch.float32]
    assert kept.dtype == torch.float32 and torch.equal(kept, widened)


def test_int8_at_load_writes_text(default_model_dir) -> None:
    llm = LLM(model=str(default_model_dir), device="cpu", quantization="int8")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    [out] = llm.generate("The capital of France is", params, use_tqdm=False)
    print(repr(out.outputs[0].text))
    assert len(out.outputs[0].token_ids) > 0
    assert sum(c.isalpha() for c in out.outputs[0].text) >= 5


@pytest.fixture(scope="module")
def gptq_dir(default_model_dir: Path, tmp_path_factory) -> Path:
    return write_gptq(default_model_dir, tmp_path_factory.mktemp("gptq-rtn"), GROUP)


def test_gptq_4bit_agrees_with_the_unquantized_model(gptq_dir, text_ids, reference_top1) -> None:
    share = agreement(load_ours(gptq_dir), text_ids, reference_top1)
    print(f"4-bit (GPTQ RTN, g{GROUP}) top-1 agreement over {len(text_ids)} positions: {share:.1%}")
    assert share >= 0.68


def readme_answer(model: Path, quantization: str | None, dtype: str = "auto") -> str:
    """The README's question, greedy, as its curl example asks it."""
    llm = LLM(model=str(model), device="cpu", quantization=quantization, dtype=dtype)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    [out] = llm.chat(question, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return out.outputs[0].text


def test_fp8_at_load_answers_the_readme_question(default_model_dir) -> None:
    assert "Paris" in readme_answer(default_model_dir, "fp8")


@BF16_MODE
def test_bfloat16_on_cpu_answers_the_readme_question_as_float32_does(default_model_dir) -> None:
    """Its two likeliest first tokens are 0.04 apart: with the bf16 lm_head's logits alone the
    mode answered "L'Étoile, la Marseillaise, ..."; the refined top logits keep fp32's answer."""
    answer = readme_answer(default_model_dir, None, "bfloat16")
    assert answer == readme_answer(default_model_dir, None) and "Paris" in answer


def test_gptq_4bit_answers_the_readme_question(gptq_dir) -> None:
    assert "Paris" in readme_answer(gptq_dir, None)


def test_bfloat16_on_a_cpu_without_a_bf16_gemm_is_refused_at_load(
    default_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither the CPU GEMM (no AVX2 and FMA) nor oneDNN's bf16 GEMM: the mode fails at load
    with a message that names what it needs and the float32 default, not in the first GEMM."""
    for name in ("native_bf16", "cpu_gemm_available", "onednn_bf16"):
        monkeypatch.setattr(cpu_bf16, name, lambda: False)
    with pytest.raises(ValueError, match=r"AVX2 and FMA.*AVX-512 BW, VL and DQ.*float32"):
        load_ours(default_model_dir, dtype="bfloat16")
