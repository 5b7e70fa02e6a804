#!/usr/bin/env bash
# The one-shot W4A16 decode GEMV on one H200, by stage: `scripts/h200_wna16_gemv.sh OUT STAGE...`.
# Every stage writes its JSON under OUT and appends to OUT/log.txt, each step under its own time limit.
# Stages:
#   tests    the W4A16 kernel's GPU tests at the 8B shapes and the one-shot GEMV's (tests/gpu/test_wna16_gpu.py)
#   before   batch-1 and batch-8 decode (prompt 128) of the Llama-3-8B shape, W4A16 group 128, committed table
#   sweep    scripts/h200_wna16_gemv.py: one-shot candidates against the table and cuBLAS -> OUT/wna16_nvidia_h200.json
#   table    the sweep's table put in kestrel/kernels/tuning/
#   after    the `before` runs again (tag `after`)
#   gputests the one-shot GEMV's GPU tests and the CUDA-graph ones (a batch drained and refilled)
#   tput     full load under the table: 384 x 1000 in / 1000 out, W4A16, max_num_seqs 256 (the check a default needs)
source "$(dirname "$0")/h200_job.sh" "$1"; shift
w4_decode() { latency 150 llama3-8b-w4a16-g128-$1 --weight-only w4a16 --batch 1,8 --input-len 128 --output-len 64 \
  --repeats 2; }
for stage in "$@"; do
  case $stage in
    tests) run 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_wna16_gpu.py -k "oneshot or 8b_shapes" ;;
    before) w4_decode before ;;
    sweep) run 420 python3 scripts/h200_wna16_gemv.py --out "$out" ;;
    table) cp "$out/wna16_nvidia_h200.json" kestrel/kernels/tuning/wna16_nvidia_h200.json \
             && echo "table in place" | tee -a "$out/log.txt" ;;
    after) w4_decode after ;;
    tput) run 240 python3 -m kestrel.bench.throughput --weight-only w4a16 --hf-peer-prompts 0 --num-prompts 384 \
            --input-len 1000 --output-len 1000 --max-seconds 150 \
            --result-file "$out/throughput-llama3-8b-w4a16-oneshot-h200.json" ;;
    gputests) run 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_wna16_gpu.py -k oneshot
              run 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graph_gpu.py ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
