#!/usr/bin/env bash
# The decode path's launch features (kernels/common.py LAUNCH_FEATURES) on one GPU, by stage:
# `scripts/h200_launches.sh OUT STAGE...`. Each measurement runs with the features off (no decode_launches table),
# as committed (the GPU's table in the tree) or on (a table naming every one). Stages:
#   tests    (features on) the GPU tests of the kernels touched
#   smoke    (features on) Qwen3 / Qwen3-MoE / Gemma 3 greedy parity
#   moe      batch-1 and batch-8 decode (prompt 128) of the Qwen3-30B-A3B shape, FP8 + FP8 KV: committed, on
#            (what the features the table leaves off add)
#   moe-off  the same: off, on
#   moe-bf16 the same in BF16: committed, on
#   dense    batch-1 decode of the Llama-3-8B shape, FP8 + FP8 KV and W4A16 group 128: off, on
#   tput     (features on) full load, 1000 x 1000 in / 1000 out, FP8 + FP8 KV, max_num_seqs 512, Llama-3-8B
#   tput-moe (features on) the same for the Qwen3-30B-A3B shape
#   tput-off (features off) the Llama-3-8B full load again, the baseline of `tput` on the same machine
#   profile  (features on) the FP8 Qwen3-30B-A3B batch-1 decode step by kernel
source "$(dirname "$0")/h200_job.sh" "$1"; shift
h200_tables
committed=$(mktemp)
cp $tuning/decode_launches_$key.json "$committed" 2>/dev/null || echo '{"configs": {}}' > "$committed"
features() {  # features off | committed | on
  rm -f $tuning/decode_launches_$key.json
  [ "$1" = committed ] && cp "$committed" $tuning/decode_launches_$key.json
  [ "$1" = on ] && python3 -c "
import json; from kestrel.kernels.common import LAUNCH_FEATURES
json.dump({'gpu': '$key', 'configs': {n: True for n in LAUNCH_FEATURES}}, open('$tuning/decode_launches_$key.json', 'w'))"
  echo "launch features $1" | tee -a "$out/log.txt"; }
qwen=(--arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 2)
llama=(--batch 1 --input-len 128 --output-len 64 --repeats 2)
for stage in "$@"; do
  case $stage in
    tests) features on
           run 300 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gemv_gpu.py \
             tests/gpu/test_moe_small_t_gpu.py tests/gpu/test_fused_moe_gpu.py tests/gpu/test_cuda_graph_gpu.py \
             tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_wna16_gpu.py tests/kernels/test_rope_kv_kernel.py \
             tests/kernels/test_attention_triton.py tests/kernels/test_moe_small_t.py ;;
    smoke) features on
           run 150 python3 scripts/gpu_smoke.py --out "$out/smoke" --archs qwen3,qwen3_moe,gemma3 --methods fp8 \
             --skip-engine-checks ;;
    moe|moe-off) first=committed; [ $stage = moe-off ] && first=off
         for f in $first on; do features $f
           latency 150 qwen3-30b-a3b-fp8-$f "${qwen[@]}" --quantization fp8 --kv-cache-dtype fp8; done ;;
    moe-bf16) for f in committed on; do features $f; latency 150 qwen3-30b-a3b-bf16-$f "${qwen[@]}"; done ;;
    dense) for f in off on; do features $f
             latency 100 llama3-8b-fp8-$f "${llama[@]}" --quantization fp8 --kv-cache-dtype fp8
             latency 120 llama3-8b-w4a16-$f "${llama[@]}" --weight-only w4a16; done ;;
    tput|tput-moe|tput-off) f=on; arch=llama3-8b; tag=launch-features
          [ $stage = tput-moe ] && arch=qwen3-30b-a3b; [ $stage = tput-off ] && f=off && tag=no-launch-features
          features $f
          run 280 python3 -m kestrel.bench.throughput --arch $arch --quantization fp8 --kv-cache-dtype fp8 \
            --max-num-seqs 512 --hf-peer-prompts 0 --max-seconds 200 \
            --result-file "$out/throughput-$arch-fp8-1000x1000-$tag-h200.json" ;;
    profile) features on
             run 150 python3 scripts/h200_decode_profile.py --out "$out" --arch qwen3-30b-a3b --tag launch-features \
               --precisions fp8 ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
features off
