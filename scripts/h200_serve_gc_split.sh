#!/usr/bin/env bash
# Issue 29's serving rows, three ways in one job on one machine: `kestrel serve` in process with CPython's default
# collector (the code before `tune_for_serving`), in process as it now runs (collector tuned), and with the engine
# core in its own process (`--engine-core-process`, collector tuned in both processes). Llama-3-8B shape, random
# weights, FP8 + FP8 KV, max_num_seqs 128, 32 streams of 1000 in / 200 out twice after 64 warm-up requests.
# Then `kestrel bench host-step` on this host, in process and split, at batch 64 and 256.
# Usage: scripts/h200_serve_gc_split.sh OUT serve [ROUND...]|host-step   (the wheels of the server's packages set up by the caller)
set -uo pipefail
out=$1
mkdir -p "$out"
export PYTHONUNBUFFERED=1
model=/tmp/serve-model
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/device.txt"
serve_flags=(--model $model --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 128
             --max-model-len 2048 --port 8011 --log-level info)
one() {  # one() TAG LAUNCHER...: a server, the 32-stream level twice, the server stopped
  local tag=$1; shift
  local t0=$SECONDS
  "$@" "${serve_flags[@]}" > "$out/server-$tag.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 240); do curl -sf http://127.0.0.1:8011/health >/dev/null && break
    kill -0 $server 2>/dev/null || { echo "== $tag: the server exited"; tail -3 "$out/server-$tag.log"; return 1; }
    sleep 1; done
  echo "== $tag: up after $((SECONDS - t0)) s"
  python3 -m kestrel.bench.serve --base-url http://127.0.0.1:8011 --input-len 1000 --output-len 200 \
    --ignore-eos --concurrency 32,32 --num-prompts 256 --warmup-requests 64 --save-requests \
    --result-file "$out/serve-fp8-concurrency-32-$tag.json" 2>&1 | tail -8
  kill -TERM $server; wait $server
  grep -h "garbage collector" "$out/server-$tag.log" | head -2
}
cli=(python3 -m kestrel.entrypoints.cli serve)
untuned=(python3 -c "import sys; import kestrel.entrypoints.server as s; s.tune_for_serving = lambda: 0
from kestrel.entrypoints.cli import main; sys.argv = ['kestrel', 'serve'] + sys.argv[1:]; sys.exit(main())")
if [ "$2" = serve ]; then
[ -d $model ] || python3 scripts/write_serve_model.py $model >/dev/null
shift 2
rounds=${*:-1 2}
for round in $rounds; do
  one "default-gc-r$round" "${untuned[@]}"
  one "serving-gc-r$round" "${cli[@]}"
  one "split-serving-gc-r$round" "${cli[@]}" --engine-core-process
done
exit 0
fi
python3 scripts/write_bench_tokenizer.py --out /tmp/tok128k >/dev/null
for b in 64 256; do
  python3 -m kestrel.bench.host_step --tokenizer /tmp/tok128k --batch $b --repeats 3 --clock cpu \
    --modes unconstrained,constrained --serving-gc > "$out/host-step-b$b.txt" 2>&1
  python3 -m kestrel.bench.host_step --tokenizer /tmp/tok128k --batch $b --repeats 3 --split \
    --modes unconstrained,constrained --serving-gc > "$out/host-step-split-b$b.txt" 2>&1
  tail -6 "$out/host-step-b$b.txt" "$out/host-step-split-b$b.txt"
done
