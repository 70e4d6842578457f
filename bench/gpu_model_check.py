"""GPU correctness of the whole model path, in one run on the GPU machine.

1. Random-weight Qwen3-0.6B and Llama-3.2-1B shapes in bf16: our prefill logits (Triton backend)
   against HF transformers on the same weights, as relative error, next to HF bf16 vs HF fp32.
2. Greedy generation: Triton backend == torch backend on the same GPU for the first tokens, with
   and without CUDA graphs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import triton

from asyncllm import LLM, SamplingParams
from asyncllm.attention.backend import AttentionMetadata
from asyncllm.models.shapes import SHAPES

KV_CACHE_BYTES = 4 << 30


def save_random_model(shape: str, folder: Path) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(**SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # fp32 weights on disk: each side casts them itself, so fp32 runs compare exactly
    model.save_pretrained(folder)
    return model.eval()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()
def our_prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    runner = llm.core_client.core.executor.model_runner
    n, bs = len(ids), runner.block_size
    blocks = list(range(-(-n // bs)))
    device = runner.device
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=device),
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        max_query_len=n,
        max_seq_len=n,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    tokens = torch.tensor(ids, device=device)
    hidden = runner.model(tokens, torch.arange(n, device=device), runner.kv_caches, meta)
    return runner.model.compute_logits(hidden)


def check_logits(shape: str, folder: Path, hf: transformers.PreTrainedModel) -> dict:
    """Relative error of logits against HF fp32: ours in fp32 (the math) and in bf16 (the
    precision), next to HF's own bf16 error, which sets the scale of what bf16 allows."""
    vocab = SHAPES[shape]["vocab_size"]
    ids = torch.randint(100, vocab, (333,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens = torch.tensor([ids], device="cuda")
    with torch.inference_mode():
        reference = hf(tokens).logits[0].float()
        hf_bf16 = hf.to(torch.bfloat16)(tokens).logits[0].float()
    result = {"tokens": len(ids), "hf_bf16_vs_hf_fp32": relative_error(hf_bf16, reference)}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(
            model=str(folder), dtype=dtype, kv_cache_memory=KV_CACHE_BYTES, enforce_eager=True
        )
        ours = our_prefill_logits(llm, ids)
        result[f"ours_{dtype}_vs_hf_fp32"] = relative_error(ours, reference)
        result[f"ours_{dtype}_argmax_agreement"] = float(
            (ours.argmax(-1) == reference.argmax(-1)).float().mean()
        )
        release(llm)
    result["hf_bf16_argmax_agreement"] = float(
        (hf_bf16.argmax(-1) == reference.argmax(-1)).float().mean()
    )
    result["ok"] = (
        result["ours_float32_vs_hf_fp32"] < 1e-3
        and result["ours_bfloat16_vs_hf_fp32"] <= 1.5 * result["hf_bf16_vs_hf_fp32"] + 1e-3
    )
    return result


def greedy(
    folder: Path, backend: str, eager: bool, prompts: list[list[int]], n: int
) -> list[list[int]]:
    llm = LLM(
        model=str(folder),
        kv_cache_memory=KV_CACHE_BYTES,
        attention_backend=backend,
        enforce_eager=eager,
        max_num_seqs=64,
    )
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    release(llm)
    return [o.outputs[0].token_ids for o in outputs]


def check_greedy(shape: str, folder: Path) -> dict:
    rng = torch.Generator().manual_seed(2)
    vocab = SHAPES[shape]["vocab_size"]
    prompts = [
        torch.randint(100, vocab, (int(n),), generator=rng).tolist()
        for n in (5, 17, 64, 130, 200, 333, 512, 1000)
    ]
    n = 16
    runs = {
        "torch_eager": greedy(folder, "torch", True, prompts, n),
        "triton_eager": greedy(folder, "triton", True, prompts, n),
        "triton_cuda_graphs": greedy(folder, "triton", False, prompts, n),
    }
    base = runs["torch_eager"]

    def first_equal(run: list[list[int]]) -> list[int]:
        """Per prompt: how many leading tokens equal the torch backend's."""
        counts = []
        for a, b in zip(run, base):
            k = 0
            while k < len(a) and a[k] == b[k]:
                k += 1
            counts.append(k)
        return counts

    return {
        "prompts": len(prompts),
        "new_tokens": n,
        "triton_eager_leading_equal_tokens": first_equal(runs["triton_eager"]),
        "triton_graphs_leading_equal_tokens": first_equal(runs["triton_cuda_graphs"]),
        "graphs_equal_eager_exactly": runs["triton_cuda_graphs"] == runs["triton_eager"],
    }


def release(llm: LLM) -> None:
    llm.core_client.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
        },
        "models": {},
    }
    for shape in ("qwen3-0.6b", "llama-3.2-1b"):
        start = time.perf_counter()
        folder = Path(tempfile.mkdtemp(prefix=shape))
        hf = save_random_model(shape, folder)
        entry = {"logits": check_logits(shape, folder, hf)}
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        entry["greedy"] = check_greedy(shape, folder)
        entry["seconds"] = time.perf_counter() - start
        result["models"][shape] = entry
        print(shape, json.dumps(entry, indent=1), flush=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
