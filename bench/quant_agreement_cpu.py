"""Top-1 agreement of a quantized mode with fp32 on real text, teacher forced, on CPU.

Both engines read the same tokens of real English (tests/data/quant_agreement_text.md, the
README as it was when the quantization tests were written, unless --text names another file)
as one prompt; each position's most likely next token comes from its prompt logprobs (the token
of rank 1), and the result is the share of positions where the two agree. The issue's targets:
98% for a lower-precision CPU mode (int8, or --quantization none --dtype bfloat16), 95% for
FP8; the 4-bit figure is reported.

--quantization int8 and fp8 quantize the weights as they load; gptq and gptq-rtn write a 4-bit
GPTQ checkpoint of the model first (bench/gptq_checkpoint.py, asymmetric, groups of 32: by
GPTQ over 2,048 tokens of calibration text, the standard library's docstrings, or rounded to
nearest) and load that. Each run also answers the README's question with the quantized model.

    python bench/quant_agreement_cpu.py --quantization int8 --out bench/results/quant_agreement_int8_cpu.json
    python bench/quant_agreement_cpu.py --quantization fp8 --out bench/results/quant_agreement_fp8_cpu.json
    python bench/quant_agreement_cpu.py --quantization gptq-rtn --out bench/results/quant_agreement_gptq_rtn_cpu.json
    python bench/quant_agreement_cpu.py --quantization gptq --out bench/results/quant_agreement_gptq_cpu.json
    python bench/quant_agreement_cpu.py --quantization none --dtype bfloat16 --out bench/results/quant_agreement_bf16_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm import LLM, SamplingParams
from asyncllm.model_files.model_path import resolve_model_path
from bench.gptq_checkpoint import calibration_hessians, write_gptq
from bench.throughput import cpu_description

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "quant_agreement_text.md"
TARGETS = {"int8": 0.98, "none": 0.98, "fp8": 0.95}
GPTQ_GROUP = 32
CALIBRATION_TOKENS = 2048
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def top1_per_position(llm: LLM, ids: list[int]) -> list[int]:
    """The rank-1 next token after each prefix ids[:p], p = 1 .. len(ids) - 1."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    [output] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    return [
        next(token for token, logprob in position.items() if logprob.rank == 1)
        for position in output.prompt_logprobs[1:]
    ]


def readme_answer(llm: LLM) -> str:
    """The README's question, greedy."""
    params = SamplingParams(temperature=0, max_tokens=16)
    return llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0].text


def quantized_llm(path: Path, quantization: str, dtype: str, scratch: Path) -> LLM:
    """int8 and fp8 quantize at load; gptq and gptq-rtn load a checkpoint written here; none
    runs the model's weights in `dtype`."""
    if quantization.startswith("gptq"):
        hessians = None
        if quantization == "gptq":
            hessians = calibration_hessians(path, CALIBRATION_TOKENS)
        model = write_gptq(path, scratch, GPTQ_GROUP, hessians)
        return LLM(model=str(model), device="cpu", dtype=dtype)
    method = None if quantization == "none" else quantization
    return LLM(model=str(path), device="cpu", quantization=method, dtype=dtype)


def gptq_settings(quantization: str) -> dict | None:
    if quantization == "gptq-rtn":
        return {"method": "round to nearest", "group_size": GPTQ_GROUP, "symmetric": False}
    if quantization == "gptq":
        return {"method": "GPTQ", "group_size": GPTQ_GROUP, "symmetric": False,
                "calibration": f"{CALIBRATION_TOKENS} tokens of standard-library docstrings"}  # fmt: skip
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF (None: SmolLM2-135M)")
    parser.add_argument(
        "--quantization",
        default="int8",
        choices=("none", "int8", "fp8", "gptq", "gptq-rtn"),
        help="against fp32 (none: only --dtype)",
    )
    parser.add_argument("--dtype", default="float32", help="the mode's dtype (bfloat16, ...)")
    parser.add_argument("--text", type=Path, default=TEXT, help="real text to read")
    parser.add_argument("--positions", type=int, default=300, help="tokens of the text read")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(args.text.read_text())["input_ids"][: args.positions]
    reference = top1_per_position(LLM(model=str(path), device="cpu"), ids)
    with tempfile.TemporaryDirectory() as scratch:
        llm = quantized_llm(path, args.quantization, args.dtype, Path(scratch))
        quantized = top1_per_position(llm, ids)
        answer = readme_answer(llm)
    agreeing = sum(a == b for a, b in zip(reference, quantized))
    result = {
        "benchmark": "quant_agreement_cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "cpu": cpu_description(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model": str(path),
        "quantization": args.quantization,
        "dtype": args.dtype,
        "gptq": gptq_settings(args.quantization),
        "text": args.text.name,
        "positions": len(reference),
        "top1_agreement_vs_fp32": agreeing / len(reference),
        "target": TARGETS.get(args.quantization),
        "readme_question": QUESTION[0]["content"],
        "readme_answer": answer,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
