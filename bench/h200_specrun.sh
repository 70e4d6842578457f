#!/usr/bin/env bash
# Speculation that runs ahead (issue 24, branch specrun), on one H200 in under 200 s:
#   bench/h200_specrun.sh OUT
# 1. bench/spec_decode.py, Llama-3.1-8B shape with dummy weights, replayed greedy drafts at
#    70% acceptance, 4 tokens, batch 1 and 32, against no speculation in the same process, and
#    the same speculating runs with nothing scheduled ahead (what run-ahead changes); then a
#    torch.profiler table of an extra (untimed) batch-1 speculating run   ~100 s (115 at most)
# 2. the GPU tests of speculation, in the time left of 190 s: steps run ahead with drafts made
#    on the device (tests/test_spec_run_ahead.py, float32), the verify graphs
#    (tests/test_spec_gpu.py), drafts under grammars (tests/test_structured_spec_gpu.py) ~80 s
# Each part runs under its own timeout; one failing does not stop the other.
set -uo pipefail
out=$(realpath -m "$1")
mkdir -p "$out"
SECONDS=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

timeout 115 python3 bench/spec_decode.py --shape llama-3.1-8b --acceptance 0.7 \
  --num-speculative-tokens 4 --batch-sizes 1 32 --out "$out/spec_decode_h200.json" \
  --profile "$out/spec_profile_b1_h200.txt" > "$out/spec_decode_h200.txt" 2>&1
echo "spec_decode: exit $? after $SECONDS s"
tail -3 "$out/spec_decode_h200.txt"

left=$((190 - SECONDS)); ((left < 20)) && left=20
timeout $left python3 -m pytest -rf -q -p no:cacheprovider tests/test_spec_run_ahead.py \
  tests/test_spec_gpu.py tests/test_structured_spec_gpu.py > "$out/gpu_tests_specrun_h200.txt" 2>&1
echo "tests: exit $? after $SECONDS s"
tail -3 "$out/gpu_tests_specrun_h200.txt"
grep -h "engine step failed" "$out"/*.txt 2>/dev/null | head -3
