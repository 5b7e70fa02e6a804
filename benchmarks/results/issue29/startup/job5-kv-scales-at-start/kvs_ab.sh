#!/usr/bin/env bash
# Start-up before / after calculate_kv_scales (the bench's FP8-KV engine calibrated inside its start-up, one
# capture instead of three), alternated, each cold; then the GPU tests of the graphs and the scales. "before" is the
# working tree with scratch/kv-scales.patch reversed: the kestrel/ diff of commit 9334301 less its compile-ahead of
# the calibration's forward (which came after this job).
source scripts/h200_job.sh "$1"; shift
h200_tables
rm -rf /tmp/before && cp -r . /tmp/before && (cd /tmp/before && patch -s -R -p1 < scratch/kv-scales.patch) || exit 1
tput() { local tree=$1 name=$2 seqs=$3
  (cd "$tree" && run 150 env TRITON_CACHE_DIR="$(mktemp -d)" python3 -m kestrel.bench.throughput --num-prompts 32 \
    --input-len 128 --output-len 16 --hf-peer-prompts 0 --max-num-seqs "$seqs" --quantization fp8 \
    --kv-cache-dtype fp8 --tokenizer .bench-tokenizer-128k --result-file "$out/throughput-start-$name-h200.json"); }
for round in 1 2; do
  tput . "after-512-$round" 512
  tput /tmp/before "before-512-$round" 512
done
tput . after-128 128
tput /tmp/before before-128 128
run 200 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_cuda_graph_gpu.py
pack_results
