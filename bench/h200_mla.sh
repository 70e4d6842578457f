#!/usr/bin/env bash
# Issue 22's paged MLA decode on one H200, in under 180 s:
#   bench/h200_mla.sh OUTDIR
# the MLA GPU tests (gpu_tests_mla_h200.txt), then bench/mla_sweep.py: every candidate config
# per batch x context against the copy bandwidth of the same run, the breakdown of the best
# and the CONFIG_TABLE to adopt (mla_sweep_h200.json, its printout in mla_sweep_h200.txt;
# the JSON is rewritten after each case, so a time limit keeps what finished).
set -uo pipefail
start=$SECONDS
out=$(realpath -m "$1")
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 65 python3 -m pytest -rf -q -p no:cacheprovider tests/test_mla_kernels.py \
  tests/test_mla_rope.py > "$out/gpu_tests_mla_h200.txt" 2>&1
echo "MLA GPU tests: exit $? after $((SECONDS - start)) s"
tail -3 "$out/gpu_tests_mla_h200.txt"
left=$((175 - (SECONDS - start)))  # the whole script, the install included, under 180 s
timeout "$left" python3 bench/mla_sweep.py --out "$out/mla_sweep_h200.json" \
  > "$out/mla_sweep_h200.txt" 2>&1
echo "MLA sweep: exit $? after $((SECONDS - start)) s (limit $left s)"
grep -A 40 "^copy bandwidth" "$out/mla_sweep_h200.txt" || tail -20 "$out/mla_sweep_h200.txt"
