#!/usr/bin/env bash
# The prescaled W4A16 tiles (issue 28) by stage: `scripts/h200_wna16_prescale.sh OUT STAGE...`; every stage
# appends to OUT/log.txt under its own time limit.
# Stages:
#   tables     the H200's tuning tables copied under this GPU's name when it is another
#   sweep      scripts/h200_wna16_prescale.py: the prescaled tiles against the table, the dense path and cuBLAS
#   tests      the W4A16 GPU tests (the prescaled tiles, the table-driven paths, the GGUF forms), failures named
#   lat-NAME   Llama-3-8B W4A16 group 128 (random compressed-tensors checkpoint), decode at batch 1, 8, 32, 128,
#              prompt 128: OUT/latency-llama3-8b-w4a16-NAME-h200.json
#   tput-NAME  its full load, 384 prompts x 1000 in / 1000 out at max_num_seqs 256 (a batch drained and refilled):
#              OUT/throughput-llama3-8b-w4a16-NAME-h200.json
#   table=PATH the wna16 table at PATH (a JSON file in the tree) installed for this GPU, for the stages after it
#   pack       everything under OUT in OUT/results.tar.gz
source "$(dirname "$0")/h200_job.sh" "$1"; shift
for stage in "$@"; do
  case $stage in
    tables) h200_tables ;;
    sweep) run 560 python3 scripts/h200_wna16_prescale.py --out "$out" --max-seconds "${SWEEP_SECONDS:-420}" ;;
    tests) workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # compiles in 8 processes where it can
           run 400 python3 -m pytest -q -rf -p no:cacheprovider $workers tests/gpu/test_wna16_gpu.py ;;
    lat-*) latency 200 "llama3-8b-w4a16-${stage#lat-}" --weight-only w4a16 --batch 1,8,32,128 --input-len 128 \
             --output-len 64 ;;
    tput-*) run 240 python3 -m kestrel.bench.throughput --weight-only w4a16 --hf-peer-prompts 0 --num-prompts 384 \
              --input-len 1000 --output-len 1000 --max-num-seqs 256 --max-seconds 150 \
              --result-file "$out/throughput-llama3-8b-w4a16-${stage#tput-}-h200.json" ;;
    table=*) key=$(python3 -c "from kestrel.kernels.common import gpu_key, device_name; print(gpu_key(device_name(0)))")
             cp "${stage#table=}" "kestrel/kernels/tuning/wna16_$key.json"
             echo "wna16 table ${stage#table=} installed as $key" | tee -a "$out/log.txt" ;;
    pack) pack_results ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
