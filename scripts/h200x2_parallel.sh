#!/usr/bin/env bash
# Issue 18 on one nvidia-h200-x2 machine (two H200s), one device call (<= 10 minutes) per stage:
#   scripts/h200x2_parallel.sh OUT STAGE [--smoke]
# STAGE (device time, estimated):
#   allreduce       kestrel bench allreduce, 2 GPUs: per-layer all-reduce at decode batches vs bus bandwidth (~2 min)
#   8b-latency      8B FP8 + FP8 KV, batch 1 and 32: TP=1 in process, TP=2, PP=2 through mp (~5 min)
#   8b-throughput   8B FP8 + FP8 KV, 1000 x (1000 in / 1000 out) at TP=1, TP=2, PP=2; each timed run capped at
#                   120 s (a capped run says "truncated" and its rates cover the part done) (~8 min)
#   70b-bf16        70B BF16 TP=2: batch-1 decode vs roofline; 1000 x 1000/1000 throughput capped at 180 s (~8 min)
#   70b-fp8         70B W8A8-FP8 + FP8 KV, batch 1 and 32: TP=2, then TP=1 (72.7 GB of weights; fits or says why) (~5 min)
#   greedy-parity   TP=2 and PP=2 greedy tokens vs TP=1 on a written random 8B checkpoint (BF16) (~4 min)
#   table           the issue's ratios and tables from the JSON under OUT (no GPU)
#   all             every stage in order (for --smoke; on GPUs it exceeds one call)
# Each run writes OUT/<run>.json (+ .png) and appends to OUT/<stage>.log; a run that fails leaves no complete JSON
# and the stage goes on. --smoke passes --smoke to every bench: tiny models, gloo ranks on the CPU.
set -uo pipefail
out=${1:?usage: scripts/h200x2_parallel.sh OUT STAGE [--smoke]}
stage=${2:?usage: scripts/h200x2_parallel.sh OUT STAGE [--smoke]}
smoke=()
if [[ "${3:-}" == "--smoke" ]]; then smoke=(--smoke); elif [[ -n "${3:-}" ]]; then
  echo "unknown option ${3}; the only one is --smoke" >&2; exit 2; fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The checkout this script is in, also for scripts/*.py (whose own directory would come first on sys.path).
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
failed=0

# run LOG LIMIT_S NAME MODULE_OR_SCRIPT ARGS...: one bench process, stopped after LIMIT_S seconds.
run() {
  local log=$1 limit=$2 name=$3 what=$4; shift 4
  local cmd=("$py" -m "$what")
  [[ "$what" == *.py ]] && cmd=("$py" "$what")
  echo "== $name: ${cmd[*]} $* ${smoke[*]}" | tee -a "$out/$log.log"
  timeout "$limit" "${cmd[@]}" "$@" "${smoke[@]}" --result-file "$out/$name.json" 2>&1 | tee -a "$out/$log.log"
  local rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then echo "== $name: exit $rc" | tee -a "$out/$log.log"; failed=1; fi
}

mp=(--distributed-executor-backend mp)
fp8=(--quantization fp8 --kv-cache-dtype fp8)
lat=(--input-len 128 --output-len 128 --repeats 3 --warmups 1 --hf-peer none --no-checks)
thr=(--num-prompts 1000 --input-len 1000 --output-len 1000 --hf-peer-prompts 0)

stage_allreduce() {
  run allreduce 300 allreduce kestrel.bench.allreduce --world-size 2
}
stage_8b_latency() {
  local b=(--arch llama3-8b "${fp8[@]}" --batch 1,32 "${lat[@]}")
  run 8b-latency 200 8b-latency-tp1 kestrel.bench.latency "${b[@]}"
  run 8b-latency 200 8b-latency-tp2 kestrel.bench.latency "${b[@]}" -tp 2 "${mp[@]}"
  run 8b-latency 200 8b-latency-pp2 kestrel.bench.latency "${b[@]}" -pp 2 "${mp[@]}"
}
stage_8b_throughput() {
  local b=(--arch llama3-8b "${fp8[@]}" "${thr[@]}" --max-seconds 120)
  run 8b-throughput 190 8b-throughput-tp1 kestrel.bench.throughput "${b[@]}"
  run 8b-throughput 190 8b-throughput-tp2 kestrel.bench.throughput "${b[@]}" -tp 2 "${mp[@]}"
  run 8b-throughput 190 8b-throughput-pp2 kestrel.bench.throughput "${b[@]}" -pp 2 "${mp[@]}"
}
stage_70b_bf16() {
  run 70b-bf16 200 70b-bf16-latency-tp2 kestrel.bench.latency --arch llama3-70b --batch 1 "${lat[@]}" -tp 2 "${mp[@]}"
  run 70b-bf16 360 70b-bf16-throughput-tp2 kestrel.bench.throughput --arch llama3-70b "${thr[@]}" --max-seconds 180 \
    -tp 2 "${mp[@]}"
}
stage_70b_fp8() {
  local b=(--arch llama3-70b "${fp8[@]}" --batch 1,32 "${lat[@]}")
  run 70b-fp8 270 70b-fp8-latency-tp2 kestrel.bench.latency "${b[@]}" -tp 2 "${mp[@]}"
  run 70b-fp8 270 70b-fp8-latency-tp1 kestrel.bench.latency "${b[@]}"
}
stage_greedy_parity() {
  run greedy-parity 500 greedy-parity scripts/parallel_parity.py
}
stage_table() {
  "$py" scripts/h200x2_table.py "$out" | tee "$out/table.txt"
}

case "$stage" in
  allreduce) stage_allreduce ;;
  8b-latency) stage_8b_latency ;;
  8b-throughput) stage_8b_throughput ;;
  70b-bf16) stage_70b_bf16 ;;
  70b-fp8) stage_70b_fp8 ;;
  greedy-parity) stage_greedy_parity ;;
  table) stage_table ;;
  all) stage_allreduce; stage_8b_latency; stage_8b_throughput; stage_70b_bf16; stage_70b_fp8; stage_greedy_parity
       stage_table ;;
  *) echo "unknown stage $stage: allreduce 8b-latency 8b-throughput 70b-bf16 70b-fp8 greedy-parity table all" >&2
     exit 2 ;;
esac
exit $failed
