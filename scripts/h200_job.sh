# Sourced by the scripts/h200*.sh jobs after their stage list: `source "$(dirname "$0")/h200_job.sh" "$1"; shift`.
# Sets `out` (the job's output directory, created) and `run LIMIT CMD...` (CMD under a time limit, its output
# appended to OUT/log.txt without the device's start-up noise) and `latency LIMIT NAME ARGS...` (`kestrel bench
# latency ARGS` under `run`, its result in OUT/latency-NAME-h200.json). After `h200_tables`: `launch_feature NAME
# on|off` (one launch feature in this GPU's decode_launches table), `full_load_fp8 NAME` (1000 prompts x 1000 in /
# 1000 out, FP8 + FP8 KV, max_num_seqs 512, into OUT/throughput-fp8-1000x1000-512-NAME-h200.json, the bench's
# arguments after NAME added; with
# COUNT_COMPILES=1 every Triton compile of the run is logged in OUT/compiles-NAME.json), `ttft_fp8_pair NAME`
# (batch-1 TTFT of 8k and 128-token FP8 prompts), `prefill_profile_fp8 NAME` (an 8k FP8 prefill's kernel times) and
# `pack_results` (everything under OUT in OUT/results.tar.gz: a call brings back 8 files at most).
set -uo pipefail
out=$(realpath -m "$1")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() { local limit=$1; shift; echo "== [$limit s] $*" | tee -a "$out/log.txt"
  timeout "$limit" "$@" 2>&1 | grep -v '^USDT\|Loading weights' | tee -a "$out/log.txt"; }
latency() { local limit=$1 name=$2; shift 2
  run "$limit" python3 -m kestrel.bench.latency --hf-peer none --no-checks "$@" \
    --result-file "$out/latency-$name-h200.json"; }
h200_tables() {
  nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$out/log.txt"
  key=$(python3 -c "from kestrel.kernels.common import gpu_key, device_name; print(gpu_key(device_name(0)))")
  tuning=kestrel/kernels/tuning
  if [ "$key" != nvidia_h200 ]; then
    for f in $tuning/*_nvidia_h200.json; do cp "$f" "${f%_nvidia_h200.json}_$key.json"; done
    echo "the H200 tables copied as $key" | tee -a "$out/log.txt"
  fi; }
launch_feature() {
  python3 - "$tuning/decode_launches_$key.json" "$1" "$2" <<'PY'
import json, sys
path, name, state = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
table = json.load(open(path))
table["configs"][name] = state
json.dump(table, open(path, "w"), indent=1)
PY
  echo "$1 $2" | tee -a "$out/log.txt"; }
full_load_fp8() {
  local runner=(-m)  # COUNT_COMPILES=1: under scripts/h200_count_compiles.py, into OUT/compiles-NAME.json
  [ "${COUNT_COMPILES:-0}" = 1 ] && runner=(scripts/h200_count_compiles.py "$out/compiles-$1.json")
  run 330 python3 "${runner[@]}" kestrel.bench.throughput --num-prompts 1000 --input-len 1000 --output-len 1000 \
    --hf-peer-prompts 0 --max-seconds 280 --max-num-seqs 512 --quantization fp8 --kv-cache-dtype fp8 \
    --result-file "$out/throughput-fp8-1000x1000-512-$1-h200.json" "${@:2}"; }
ttft_fp8_pair() {  # batch-1 TTFT, FP8 + FP8 KV, 8k and 128-token prompts: OUT/latency-ttft{8k,128}-fp8-NAME-h200.json
  latency 150 "ttft8k-fp8-$1" --batch 1 --input-len 8192 --output-len 16 --repeats 3 --warmups 1 \
    --quantization fp8 --kv-cache-dtype fp8
  latency 100 "ttft128-fp8-$1" --batch 1 --input-len 128 --output-len 32 --repeats 3 \
    --quantization fp8 --kv-cache-dtype fp8; }
prefill_profile_fp8() {  # kernel times of one 8k FP8 + FP8 KV prefill, in OUT/NAME/
  mkdir -p "$out/$1"
  run 200 python3 scripts/h200_prefill_profile.py --out "$out/$1" --precisions fp8 --prompt 8192; }
pack_results() { tar -czf "$out/results.tar.gz" -C "$out" --exclude results.tar.gz .; }
