#!/usr/bin/env bash
# Issue 25's last target on the H200, in one device call of at most 150 s (the step bench 95 s,
# then the GPU tests and the CPU bench side by side, 47 s):
#   bench/h200_structured.sh OUT
# 1. batch-256 decode of the Qwen3-0.6B shape, a JSON schema of its own per request, against
#    the same batch unconstrained (target: at most 1.1x), masked with SmolLM2's tokenizer from
#    .tok/SmolLM2-135M-Instruct/: OUT/structured_step_real_tokenizer_h200.json
# 2. the structured GPU tests (grammar-checked speculation; padding logits stay masked)
# 3. on the host's CPU, xgrammar's accepts and fills of 256 rows over the tokenizer's own
#    vocabulary against the one padded to the logits (the engine's before):
#    OUT/structured_accept_fill_real_tokenizer_h200host.json
# Each part runs under its own timeout; a failing one does not stop the others.
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
  tail -n 40 "$out/$name.txt"
}

part structured_step_real_tokenizer_h200 95 python3 bench/structured.py --part step \
  --batch 256 --steps 40 --tokenizer "$tok" --out "$out/structured_step_real_tokenizer_h200.json"
# the CPU bench beside the GPU tests (16 cores; its two vocabularies alternate, so both see the
# same neighbours)
part structured_accept_fill_real_tokenizer_h200host 45 python3 bench/structured_fill.py \
  --tokenizer "$tok" --repeats 2 --out "$out/structured_accept_fill_real_tokenizer_h200host.json" \
  > "$out/cpu_part_summary.txt" &
part structured_gpu_tests_h200 47 python3 -m pytest -rf -q -p no:cacheprovider \
  tests/test_structured_spec_gpu.py
wait
cat "$out/cpu_part_summary.txt"
echo "== total $SECONDS s"
