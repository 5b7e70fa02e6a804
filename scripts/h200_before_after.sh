#!/usr/bin/env bash
# Default-settings speed of two checkouts on one H200, interleaved in one job so drift hits both alike:
#   scripts/h200_before_after.sh OUT STAGE BEFORE_DIR AFTER_DIR [ROUNDS]
# STAGE latency: kestrel.bench.latency batch 1 and 32, prompt 128 / 128 out, BF16 and W8A8-FP8 + FP8 KV, each run
# before then after, ROUNDS times (default 2); STAGE throughput: kestrel.bench.throughput 1000 x 1000/1000, FP8 + FP8 KV,
# max_num_seqs 512, before then after; STAGE smoke: scripts/gpu_smoke.py of AFTER_DIR. Each run writes
# OUT/<stage>-<before|after>-<n>.json; OUT/log.txt has everything; scripts/before_after_table.py prints the ratios.
set -uo pipefail
out=$(realpath -m "$1"); stage=$2; before=$(realpath "$3"); after=$(realpath "$4"); rounds=${5:-2}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() { local dir=$1; shift; echo "== $dir: $*" | tee -a "$out/log.txt"
        (cd "$dir" && PYTHONPATH="$dir" "$@") 2>&1 | grep -v '^USDT' | tee -a "$out/log.txt"; }
latency() { run "$1" python3 -m kestrel.bench.latency --batch 1,32 --input-len 128 --output-len 128 --repeats 3 \
              --hf-peer none --no-checks "${@:3}" --result-file "$out/$2.json"; }
case $stage in
  latency)
    for n in $(seq "$rounds"); do
      for side in before after; do
        dir=$before; [ $side = after ] && dir=$after
        latency "$dir" "latency-bf16-$side-$n"
        latency "$dir" "latency-fp8-$side-$n" --quantization fp8 --kv-cache-dtype fp8
      done
    done ;;
  throughput)
    for side in before after; do
      dir=$before; [ $side = after ] && dir=$after
      run "$dir" python3 -m kestrel.bench.throughput --num-prompts 1000 --input-len 1000 --output-len 1000 \
        --hf-peer-prompts 0 --max-seconds 200 --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 512 \
        --result-file "$out/throughput-fp8-$side-1.json"
    done ;;
  smoke) run "$after" python3 scripts/gpu_smoke.py --out "$out" ;;
  *) echo "unknown stage $stage" | tee -a "$out/log.txt"; exit 2 ;;
esac
