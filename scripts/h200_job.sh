# Sourced by the scripts/h200*.sh jobs after their stage list: `source "$(dirname "$0")/h200_job.sh" "$1"; shift`.
# Sets `out` (the job's output directory, created) and `run LIMIT CMD...` (CMD under a time limit, its output
# appended to OUT/log.txt without the device's start-up noise) and `latency LIMIT NAME ARGS...` (`kestrel bench
# latency ARGS` under `run`, its result in OUT/latency-NAME-h200.json).
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
