#!/usr/bin/env bash
# Issue 28 points 4 and 5 on one H200, in at most 420 s: bench/h200_longctx.sh OUTDIR [PARTS]
# (PARTS: the numbers of the parts to run, e.g. "0 1 2 4"; all by default)
#   0. GPU test: a 40,900-token prompt at max_model_len 40,960, chunked and preempted, through
#      the Triton kernels and CUDA graphs, equals HF transformers         expected  ~45 s
#   1. long contexts, Qwen3-0.6B shape: 64 requests, prompts U[8192, 32768], outputs U[128, 512],
#      max_model_len 40,960, against the floor of the same run              expected  ~75 s
#   2. attention at 32k contexts (bench/kernels.py's *_long sections)          expected  ~35 s
#   3. the same long-context workload on the Llama-3.1-8B shape                expected ~110 s
#   4. multi-turn chat with shared prefixes over HTTP (bench/multiturn.py) on the Qwen3-0.6B
#      shape with SmolLM2's vocabulary and tokenizer: offline, then a server at saturation and
#      at half load                                                              expected ~100 s
#   5. with what time is left (30 s at least): the prefill kernel's tiles swept over an
#      8,192-row chunk ending at 32k (the default was chosen at 4 x 4,096); prints the best
# Expected in all about 370 s, 400 with part 5. Each part runs under a timeout cut to what the
# deadline (410 s after the wheels) leaves after the expected time of the parts after it; one
# failing part does not stop the others. Results (JSON) and logs go to OUTDIR as one file,
# longctx_h200.tgz; needs the wheels in .whl/ and .tok/SmolLM2-135M-Instruct/ (see
# h200_session.sh).
set -uo pipefail
out=$(realpath -m "$1") work=/tmp/longctx_h200 parts=" ${2:-0 1 2 3 4 5} "
wants() { [[ $parts == *" $1 "* ]]; }
rm -rf "$work" && mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
deadline=$((SECONDS + 410))

limit() {  # limit CAP RESERVE: CAP seconds, or less where the later parts need RESERVE
  local left=$((deadline - SECONDS - $2))
  echo $((left < $1 ? (left > 10 ? left : 10) : $1))
}

facts() {  # the figures of a throughput result, in one line
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); a = r["asyncllm"]
print({"fraction_of_floor": round(r["fraction_of_floor"], 3), **a["engine"],
       "compiled_during_run": a["triton_kernels_compiled_during_run"]})' "$1" 2> /dev/null
}

long=(--num-requests 64 --min-len 8192 --max-len 32768 --min-output-len 128
  --max-output-len 512 --max-model-len 40960 --max-num-batched-tokens 8192 --max-num-seqs 64
  --no-peer --disable-tqdm)

if wants 0; then
echo "== 0. GPU test at max_model_len 40,960"
timeout "$(limit 70 320)" python3 -m pytest -q -p no:cacheprovider tests/test_long_context.py \
  -k gpu > "$work/gpu_tests_longctx_h200.txt" 2>&1
tail -2 "$work/gpu_tests_longctx_h200.txt"
fi

if wants 1; then
echo "== 1. long contexts, qwen3-0.6b"
timeout "$(limit 130 245)" python3 bench/throughput.py --shape qwen3-0.6b "${long[@]}" \
  --out "$work/throughput_longctx_qwen3_h200.json" > "$work/throughput_longctx_qwen3.log" 2>&1
tail -3 "$work/throughput_longctx_qwen3.log"
facts "$work/throughput_longctx_qwen3_h200.json"
fi

if wants 2; then
echo "== 2. attention at 32k"
timeout "$(limit 60 210)" python3 bench/kernels.py --sections decode_long prefill_long mixed_long \
  --long-context 32768 --out "$work/kernels_longctx_h200.json" > "$work/kernels_longctx.log" 2>&1
grep -E "^(copy|(decode|prefill|mixed)_long +\{|best|Traceback)" "$work/kernels_longctx.log"
fi

if wants 3; then
echo "== 3. long contexts, llama-3.1-8b"
timeout "$(limit 160 100)" python3 bench/throughput.py --shape llama-3.1-8b "${long[@]}" \
  --out "$work/throughput_longctx_llama8b_h200.json" > "$work/throughput_longctx_llama8b.log" 2>&1
tail -3 "$work/throughput_longctx_llama8b.log"
facts "$work/throughput_longctx_llama8b_h200.json"
fi

if wants 4; then
echo "== 4. multi-turn chat, shared prefixes"
# the Qwen3-0.6B shape with SmolLM2's vocabulary and tokenizer, as serving_model() in
# h200_session.sh makes it
python3 - <<'PY'
import json, shutil
from asyncllm.models.shapes import SHAPES
config = dict(SHAPES["qwen3-0.6b"], vocab_size=49152, bos_token_id=1, eos_token_id=2)
shutil.copytree(".tok/SmolLM2-135M-Instruct", "/tmp/q3", dirs_exist_ok=True)
json.dump(config, open("/tmp/q3/config.json", "w"))
PY
engine=(--max-model-len 4096 --max-num-batched-tokens 8192 --long-prefill-token-threshold 0
  --load-format dummy)
chats=(--num-conversations 256 --min-turns 2 --max-turns 6 --min-len 4 --max-len 1024
  --max-context 4096 --vocab-size 49152)
timeout "$(limit 70 60)" python3 bench/multiturn.py offline "${chats[@]}" --model /tmp/q3 \
  "${engine[@]}" --out "$work/multiturn_offline_h200.json" > "$work/multiturn_offline.log" 2>&1
tail -2 "$work/multiturn_offline.log"
port=8766
# in a session of its own, so that its engine core process stops with it (part 5 needs the GPU)
setsid python3 -m asyncllm.serve --model /tmp/q3 --port $port "${engine[@]}" \
  --max-concurrent-requests 0 > "$work/multiturn_server.log" 2>&1 &
server=$!
for _ in $(seq "$(limit 90 35)"); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  [[ -z $(jobs -rp) ]] && break  # the server exited
  sleep 1
done
offline=()
[[ -f $work/multiturn_offline_h200.json ]] && offline=(--offline "$work/multiturn_offline_h200.json")
timeout "$(limit 100 10)" python3 bench/multiturn.py serve "${chats[@]}" \
  --base-url "http://127.0.0.1:$port" "${offline[@]}" --out "$work/multiturn_h200.json" \
  > "$work/multiturn.log" 2>&1
tail -4 "$work/multiturn.log"
kill -TERM -- -$server 2> /dev/null
for _ in $(seq 40); do  # the server is this shell's only background job
  [[ -z $(jobs -rp) ]] && break
  sleep 0.5
done
kill -KILL -- -$server 2> /dev/null
wait $server 2> /dev/null
fi

if wants 5 && ((deadline - SECONDS >= 30)); then
  echo "== 5. prefill tiles at 32k"
  timeout "$(limit 60 0)" python3 bench/kernels.py --sections prefill_long_sweep \
    --long-context 32768 --out "$work/kernels_prefill_long_sweep_h200.json" \
    > "$work/kernels_prefill_long_sweep.log" 2>&1
  grep -E "^(copy|best|Traceback)" "$work/kernels_prefill_long_sweep.log"
fi
grep -h "engine step failed\|Error" "$work"/*.log 2> /dev/null | head -5
# one file back: the device returns at most 8 from its OUT
tar czf "$out/longctx_h200.tgz" -C "$work" .
echo "done in ${SECONDS} s: $out/longctx_h200.tgz"
