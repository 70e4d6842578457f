#!/usr/bin/env bash
# Issue 25's last target on the H200, in one device call of at most 100 s: the step bench (at
# most 76 s: two engines, the grammar process's start and its compiles of the 256 schemas), then
# the structured GPU tests (21 s of pytest last run) in what is left of the 100:
#   bench/h200_structured.sh OUT
# 1. batch-256 decode of the Qwen3-0.6B shape, a JSON schema of its own per request, against
#    the same batch unconstrained (target: at most 1.1x), masked with SmolLM2's tokenizer from
#    .tok/SmolLM2-135M-Instruct/: OUT/structured_step_real_tokenizer_h200.json
# 2. the structured GPU tests (grammar-checked speculation; padding logits stay masked)
# Each part runs under its own timeout; a failing one does not stop the other.
set -uo pipefail
out=$(realpath -m "$1")
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
tok=.tok/SmolLM2-135M-Instruct

part() {  # part NAME SECONDS COMMAND...: the command's output in OUT/NAME.txt, its tail printed
  local name=$1 seconds=$2 start=$SECONDS
  shift 2
  timeout "$seconds" "$@" > "$out/$name.txt" 2>&1
  echo "== $name: exit $?, $((SECONDS - start)) s"
  tail -n 45 "$out/$name.txt"
}

part structured_step_real_tokenizer_h200 76 python3 bench/structured.py --part step \
  --batch 256 --steps 40 --tokenizer "$tok" --out "$out/structured_step_real_tokenizer_h200.json"
part structured_gpu_tests_h200 $((98 - SECONDS)) python3 -m pytest -rf -q -p no:cacheprovider \
  tests/test_structured_spec_gpu.py
echo "== total $SECONDS s"
