#!/usr/bin/env bash
# Issue 22's MoE figures on one H200 (dummy bf16 weights), in three device calls:
#   bench/h200_moe.sh OUT kernels   GPU tests of the fused MoE, the routing kernel and the MoE
#                                   models against HF; the tile sweep (bench/moe_tune.py, 14
#                                   batch sizes, three shapes, each GEMM's tiles apart); the
#                                   kernel figures per shape with the new tables (phases,
#                                   roofline). About 250 s, at most 355.
#   bench/h200_moe.sh OUT offline   the nano-vllm offline workload and batch-1 decode of
#                                   DeepSeek-V2-Lite and Mixtral-8x7B (93 GB of dummy weights).
#                                   At most 355 s.
#   bench/h200_moe.sh OUT engine    the MoE engine's GPU tests (graphs against eager, bf16 with
#                                   async scheduling), then Qwen3-30B-A3B's offline workload and
#                                   batch 1 again (the routing kernel; 38% of the floor before),
#                                   and its batch-1 step profiled (kernels, launches a step).
#                                   At most 355 s.
#   bench/h200_moe.sh OUT gemv      the fused MoE's GEMVs at one pair a tile: their GPU tests,
#                                   the kernel figures per shape (each GEMV's settings, the
#                                   whole call with either or both), then Qwen3-30B-A3B's
#                                   offline workload, batch 1 and its step profiled. At most 560 s.
# Run the later parts while the machine is still warm from `kernels`: the tables it tuned are
# in kernels/fused_moe_configs/ there and their kernels in Triton's cache (a fresh machine
# compiles them at engine start). Run from the repository root. Each step runs under its own
# timeout; one failing step does not stop the others. The tables come back as a tarball (names
# with = and , do not return from the device); the sweep's log and JSON go to OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
set -uo pipefail
out=$(realpath -m "$1") what=${2:-kernels}
mkdir -p "$out"
shapes=(qwen3-30b-a3b deepseek-v2-lite mixtral-8x7b)
start=$SECONDS

case $what in
kernels)
  timeout 110 python3 -m pytest -rf -q -p no:cacheprovider tests/test_moe_kernels.py \
    tests/test_moe_layer.py tests/test_bench_moe.py tests/test_moe_models.py \
    > "$out/gpu_tests_moe_kernels_h200.txt" 2>&1
  tail -3 "$out/gpu_tests_moe_kernels_h200.txt"
  echo "tests done at $((SECONDS - start)) s"
  timeout 150 python3 bench/moe_tune.py --shape "${shapes[@]}" --out "$out/moe_tune_h200.json" \
    > "$out/moe_tune_h200.txt" 2>&1
  grep -E "^(precompiled|wrote)" "$out/moe_tune_h200.txt"
  tar czf "$out/fused_moe_configs.tgz" kernels/fused_moe_configs
  echo "sweep done at $((SECONDS - start)) s"
  for shape in "${shapes[@]}"; do  # the MLA kernel's figures are its own sweep's (bench/h200_mla.sh)
    timeout 30 python3 bench/moe.py kernels --shape "$shape" --no-mla \
      --out "$out/moe_kernels_${shape}_h200.json" \
      | grep -oE '"tokens": [0-9]+|"fraction_of_[a-z_]*": [0-9.]{4}' | paste -sd' '
  done
  ;;
offline)
  timeout 165 python3 bench/moe.py offline --shape deepseek-v2-lite \
    --out "$out/moe_offline_deepseek-v2-lite_h200.json" > "$out/moe_offline_deepseek-v2-lite_h200.txt" 2>&1
  tail -2 "$out/moe_offline_deepseek-v2-lite_h200.txt"
  echo "deepseek done at $((SECONDS - start)) s"
  timeout 185 python3 bench/moe.py offline --shape mixtral-8x7b \
    --out "$out/moe_offline_mixtral-8x7b_h200.json" > "$out/moe_offline_mixtral-8x7b_h200.txt" 2>&1
  tail -2 "$out/moe_offline_mixtral-8x7b_h200.txt"
  ;;
engine)
  timeout 110 python3 -m pytest -rf -q -p no:cacheprovider tests/test_moe_engine.py -k "not equals_hf" \
    > "$out/gpu_tests_moe_engine_h200.txt" 2>&1
  tail -3 "$out/gpu_tests_moe_engine_h200.txt"
  echo "tests done at $((SECONDS - start)) s"
  timeout 150 python3 bench/moe.py offline --shape qwen3-30b-a3b \
    --out "$out/moe_offline_qwen3-30b-a3b_h200.json" > "$out/moe_offline_qwen3-30b-a3b_h200.txt" 2>&1
  tail -2 "$out/moe_offline_qwen3-30b-a3b_h200.txt"
  echo "qwen3 offline done at $((SECONDS - start)) s"
  timeout 90 python3 bench/profile_decode.py --shape qwen3-30b-a3b --batch 1 --steps 64 \
    --out "$out/profile_decode_qwen3-30b-a3b_h200.json" \
    | grep -E '"(wall_ms_per_step|gpu_kernel_ms_per_step|gpu_kernel_launches_per_step)"'
  ;;
gemv)
  timeout 110 python3 -m pytest -rf -q -p no:cacheprovider tests/test_moe_kernels.py \
    tests/test_bench_moe.py > "$out/gpu_tests_moe_gemv_h200.txt" 2>&1
  tail -3 "$out/gpu_tests_moe_gemv_h200.txt"
  echo "tests done at $((SECONDS - start)) s"
  for shape in "${shapes[@]}"; do
    timeout 50 python3 bench/moe.py kernels --shape "$shape" --no-mla \
      --out "$out/moe_kernels_${shape}_h200.json" > "$out/moe_kernels_${shape}_h200.txt" 2>&1
    grep -oE '"tokens": [0-9]+|"fraction_of_[a-z_]*": [0-9.]{4}' "$out/moe_kernels_${shape}_h200.txt" \
      | paste -sd' '
  done
  echo "kernels done at $((SECONDS - start)) s"
  timeout 150 python3 bench/moe.py offline --shape qwen3-30b-a3b \
    --out "$out/moe_offline_qwen3-30b-a3b_h200.json" > "$out/moe_offline_qwen3-30b-a3b_h200.txt" 2>&1
  tail -2 "$out/moe_offline_qwen3-30b-a3b_h200.txt"
  left=$((555 - (SECONDS - start)))
  timeout "$left" python3 bench/profile_decode.py --shape qwen3-30b-a3b --batch 1 --steps 64 \
    --out "$out/profile_decode_qwen3-30b-a3b_h200.json" \
    | grep -E '"(wall_ms_per_step|gpu_kernel_ms_per_step|gpu_kernel_launches_per_step)"'
  ;;
*)
  echo "unknown part $what (kernels, offline, engine, gemv)" >&2
  ;;
esac
echo "$what: $((SECONDS - start)) s"
grep -h "engine step failed\|Traceback" "$out"/*.txt 2>/dev/null | head -3
