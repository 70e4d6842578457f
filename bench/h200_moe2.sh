#!/usr/bin/env bash
# Issue 22, second round (branch moe2) on one H200, in at most 150 s from the start:
#   1. GPU tests of what changed (at most 30 s): the interleaved rotary and in-place norm
#      kernels, the routing kernel with shared experts appended, the MLA prep kernel (bf16 too),
#      the MLA row contexts, then DeepSeek's models against HF (chunks, prefix hits, decodes,
#      mixed steps; the fused MoE with the shared experts in it).
#   2. DeepSeek-V2-Lite's offline workload and batch-1 decode (bench/moe.py offline), then 32
#      batch-1 decode steps under torch.profiler in the same engine (kernels, launches and
#      kernel time a step, the top kernels); --phases times the host's step phases and the
#      waits on the GPU (is the offline run host-bound?). Whatever is left of the 150 s.
# Qwen3-30B-A3B's batch 1 does not fit in the same 150 s (its engine start alone is about a
# minute); bench/h200_moe.sh OUT engine runs it.
# Run from the repository root: bench/h200_moe2.sh OUTDIR. Each step under its own timeout.
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
set -uo pipefail
out=$(realpath -m "$1")
mkdir -p "$out"

timeout 30 python3 -m pytest -rf -q -p no:cacheprovider tests/test_kernels_ops.py \
  tests/test_moe_layer.py tests/test_mla_kernels.py tests/test_moe_models.py \
  -k "interleaved or in_place or shared or prep_kernel or row_contexts or pure_decode or mixed_runs or (deepseek and (mixed_step or chunks))" \
  > "$out/gpu_tests_moe2_h200.txt" 2>&1
tail -3 "$out/gpu_tests_moe2_h200.txt"
echo "tests done at $((SECONDS - start)) s"

left=$((148 - (SECONDS - start)))
timeout "$left" python3 bench/moe.py offline --shape deepseek-v2-lite --phases --profile-batch1-steps 32 \
  --out "$out/moe_offline_deepseek-v2-lite_h200.json" > "$out/moe_offline_deepseek-v2-lite_h200.txt" 2>&1
tail -4 "$out/moe_offline_deepseek-v2-lite_h200.txt"
echo "moe2: $((SECONDS - start)) s"
grep -h "engine step failed\|Traceback" "$out"/*.txt 2>/dev/null | head -3
