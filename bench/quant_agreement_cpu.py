"""Top-1 agreement of a lower-precision mode (a quantization, or a dtype) with fp32 on real text,
teacher forced, on CPU.

Both engines read the same tokens of real English (tests/data/quant_agreement_text.md, the
README as it was when the quantization tests were written, unless --text names another file)
as one prompt; each position's most likely next token comes from its prompt logprobs (the token
of rank 1), and the result is the share of positions where the two agree. The issue's target
for a lower-precision CPU mode is 98%.

    python bench/quant_agreement_cpu.py --quantization int8 --out bench/results/quant_agreement_int8_cpu.json
    python bench/quant_agreement_cpu.py --quantization none --dtype bfloat16 --out bench/results/quant_agreement_bf16_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import transformers

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm import LLM, SamplingParams
from asyncllm.model_files.model_path import resolve_model_path
from bench.throughput import cpu_description

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "quant_agreement_text.md"


def top1_per_position(
    model: str, ids: list[int], quantization: str | None, dtype: str = "float32"
) -> list[int]:
    """The rank-1 next token after each prefix ids[:p], p = 1 .. len(ids) - 1."""
    llm = LLM(model=model, device="cpu", quantization=quantization, dtype=dtype)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    [output] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    return [
        next(token for token, logprob in position.items() if logprob.rank == 1)
        for position in output.prompt_logprobs[1:]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF (None: SmolLM2-135M)")
    parser.add_argument(
        "--quantization", default="int8", help="the mode against fp32 (none: only --dtype)"
    )
    parser.add_argument("--dtype", default="float32", help="the mode's dtype (bfloat16, ...)")
    parser.add_argument("--text", type=Path, default=TEXT, help="real text to read")
    parser.add_argument("--positions", type=int, default=300, help="tokens of the text read")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(args.text.read_text())["input_ids"][: args.positions]
    reference = top1_per_position(str(path), ids, None)
    quantization = None if args.quantization == "none" else args.quantization
    quantized = top1_per_position(str(path), ids, quantization, args.dtype)
    agreeing = sum(a == b for a, b in zip(reference, quantized))
    result = {
        "benchmark": "quant_agreement_cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "cpu": cpu_description(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model": str(path),
        "quantization": quantization,
        "dtype": args.dtype,
        "text": args.text.name,
        "positions": len(reference),
        "top1_agreement_vs_fp32": agreeing / len(reference),
        "target": 0.98,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
