#!/usr/bin/env bash
# Serving against offline throughput on one model folder, in one run (issue: serving at
# saturation vs offline, and ITL at half that load). Usage:
#   bench/serving_vs_offline.sh MODEL_DIR OUT_DIR [LOAD_FORMAT] [NUM_PROMPTS] [MIN_LEN] [MAX_LEN]
#                               [LONG_PREFILL]
# MODEL_DIR needs a tokenizer (text is what the serving benchmark times). Both runs cap the prompt
# tokens a request computes per step at LONG_PREFILL (default 256, 0: no cap), so that a step
# taking in a long prompt does not stall the streams beside it for long (the ITL tail).
set -euo pipefail
model=$1 out=$2 format=${3:-auto} n=${4:-256} lo=${5:-100} hi=${6:-1024} cap=${7:-256}
port=8765
engine=(--max-model-len 4096 --max-num-batched-tokens 8192 --load-format "$format"
  --long-prefill-token-threshold "$cap")
vocab=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$model/config.json")
workload=(--num-prompts "$n" --min-len "$lo" --max-len "$hi" --vocab-size "$vocab" --disable-tqdm)

python bench/throughput.py --model "$model" --num-requests "$n" --min-len "$lo" --max-len "$hi" \
  "${engine[@]}" --no-peer --out "$out/offline.json"

python -m asyncllm.serve --model "$model" --port $port "${engine[@]}" --max-concurrent-requests 0 \
  > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { tail -20 "$out/server.log"; exit 1; }
  sleep 1
done

python bench/serving.py --base-url "http://127.0.0.1:$port" "${workload[@]}" \
  --request-rate inf --out "$out/serving_saturation.json"
half=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['request_throughput'] / 2)" \
  "$out/serving_saturation.json")
python bench/serving.py --base-url "http://127.0.0.1:$port" "${workload[@]}" \
  --request-rate "$half" --out "$out/serving_half_load.json"
