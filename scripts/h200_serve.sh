#!/usr/bin/env bash
# `kestrel serve` at full load on one H200: Llama-3-8B shape, random weights, W8A8-FP8 + FP8 KV,
# max_num_seqs 128 (the top concurrency, 256, exceeds it), then `kestrel bench serve` with 1000-token prompts and
# 200 output tokens: a concurrency sweep 1 -> 256 and a Poisson rate sweep (third argument `repeat`: the
# 32-stream level twice after a 64-request warm-up). Usage: scripts/h200_serve.sh OUT MODEL_DIR [full|repeat]
set -uo pipefail
out=$1; model=$2; extra=${4:-}  # a fourth argument: more server flags, e.g. "--max-num-batched-tokens 8192"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m kestrel.entrypoints.cli serve --model "$model" --load-format dummy --quantization fp8 \
  --kv-cache-dtype fp8 --max-num-seqs 128 --max-model-len 2048 --port 8011 --log-level warning $extra \
  > "$out/server.log" 2>&1 &
server=$!
for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "the server exited"; tail -3 "$out/server.log"; exit 1; }
  sleep 1; done
bench() { python3 -m kestrel.bench.serve --base-url http://127.0.0.1:8011 --input-len 1000 --output-len 200 \
            --ignore-eos --warmup-requests 8 "$@" 2>&1 | tail -25; }
if [ "${3:-full}" = full ]; then
  bench --concurrency 1,8 --num-prompts 16 --result-file "$out/serve-fp8-concurrency-1-8-h200.json"
  bench --concurrency 32,128,256 --num-prompts 256 --result-file "$out/serve-fp8-concurrency-32-256-h200.json"
  bench --request-rate 4,8,16 --num-prompts 128 --result-file "$out/serve-fp8-poisson-h200.json"
else  # "repeat": the 32-stream level twice after a larger warm-up, per-request records kept
  bench --concurrency 32,32 --num-prompts 256 --warmup-requests 64 --save-requests \
    --result-file "$out/serve-fp8-concurrency-32-repeat${extra:+-tuned-budget}-h200.json"
fi
kill -TERM $server; wait $server
tail -5 "$out/server.log"
