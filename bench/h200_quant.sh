#!/usr/bin/env bash
# Issue 23's H200 figures in one call of at most 300 s (each part under its own timeout, one
# failing part never stops the next):
#   1. the GPU tests of the kernels and layers this work touched (the int4 GEMV's tiles loaded
#      ahead in bf16, the FP8 GEMV and its programs over row blocks, the bf16 GEMV, the
#      row-wise FP8 GEMM, the layers on CUDA)                          <= 40 s
#   2. the int4 GEMV sweep at one row (bench/int4_gemv_sweep.py)      <= 45 s
#   3. the FP8 sweeps: GEMV at one row, GEMM at 128-512 rows with where its time goes
#      (bench/fp8_gemm_sweep.py)                                     <= 55 s
#   4. batch-1 decode bf16 / int4 / FP8 and the offline workload bf16 / FP8 on the
#      Llama-3.1-8B shape, one engine load a mode (bench/quant.py), with the sweeps'
#      winners (ASYNCLLM_INT4_GEMV, ASYNCLLM_FP8_GEMV, ASYNCLLM_FP8_GEMM)   <= 160 s
# Usage: bench/h200_quant.sh OUTDIR   (from the repo root). The device returns at most 8 files
# from OUTDIR: every result, log and winner is written in a work folder and tarred into
# OUTDIR/h200_quant.tgz, and the five main files are copied beside it.
set -uo pipefail
dest=$(realpath -m "$1")
out=$(mktemp -d /tmp/h200_quant.XXXX)
mkdir -p "$dest"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

# four workers: the kernels' compiles (about 30 of them) are most of the time
timeout 40 python3 -m pytest -rf -q -p no:cacheprovider -n 4 tests/test_quant_kernels.py \
  tests/test_quant_layers.py tests/test_kernels_gemv.py -k "loaded_ahead or bf16_pairs \
  or rowwise or reads_fp8 or llama_8b or environment or cuda_fp8_and_int4 or in_turn \
  or model_shapes_in_bf16" > "$out/gpu_tests_quant_h200.txt" 2>&1
echo "tests (rc $?, $((SECONDS - start)) s): $(tail -1 "$out/gpu_tests_quant_h200.txt")"

timeout 45 python3 bench/int4_gemv_sweep.py --out "$out/int4_gemv_sweep_h200.json" \
  --winner "$out/int4_gemv_winner.json" > "$out/int4_gemv_sweep_h200.txt" 2>&1
echo "int4 sweep (rc $?, $((SECONDS - start)) s):"
tail -3 "$out/int4_gemv_sweep_h200.txt"

timeout 55 python3 bench/fp8_gemm_sweep.py --out "$out/fp8_gemm_sweep_h200.json" \
  --gemv-winner "$out/fp8_gemv_winner.json" --gemm-winner "$out/fp8_gemm_winner.json" \
  > "$out/fp8_gemm_sweep_h200.txt" 2>&1
echo "fp8 sweep (rc $?, $((SECONDS - start)) s):"
grep -E "fastest|BY_SHAPE|^gemm:" "$out/fp8_gemm_sweep_h200.txt" | cut -c1-400

# the winners of what each sweep got through (each rewrites its file as it goes); else defaults
[ -s "$out/int4_gemv_winner.json" ] && export ASYNCLLM_INT4_GEMV=$(cat "$out/int4_gemv_winner.json")
[ -s "$out/fp8_gemv_winner.json" ] && export ASYNCLLM_FP8_GEMV=$(cat "$out/fp8_gemv_winner.json")
[ -s "$out/fp8_gemm_winner.json" ] && export ASYNCLLM_FP8_GEMM=$(cat "$out/fp8_gemm_winner.json")
left=$((290 - (SECONDS - start)))
if [ "$left" -ge 30 ]; then  # timeout 0 would mean no limit
  timeout $((left > 160 ? 160 : left)) python3 bench/quant.py --part decode,offline \
    --modes bf16,int4,fp8 --offline-modes bf16,fp8 --out "$out/quant_{part}_h200.json" \
    > "$out/quant_h200.txt" 2>&1
  echo "decode and offline (rc $?, $((SECONDS - start)) s):"
  grep -E "^(decode|offline) " "$out/quant_h200.txt"
fi
[ -f "$out/quant_offline_h200.json" ] && mv "$out/quant_offline_h200.json" "$out/quant_offline_fp8_h200.json"

tar czf "$dest/h200_quant.tgz" -C "$out" .
for name in gpu_tests_quant_h200.txt int4_gemv_sweep_h200.json fp8_gemm_sweep_h200.json \
  quant_decode_h200.json quant_offline_fp8_h200.json; do
  [ -f "$out/$name" ] && cp "$out/$name" "$dest/"
done
echo "done in $((SECONDS - start)) s"
