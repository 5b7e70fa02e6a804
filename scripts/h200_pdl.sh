#!/usr/bin/env bash
# Fewer and overlapped launches on the decode path, by stage: `scripts/h200_pdl.sh OUT STAGE...`. Programmatic
# dependent launch, the q/k norms in the RoPE launch, the split-KV merge and the MoE k-sum by last arrival. Earlier
# code lies in abtree/<tag>/kestrel (`git archive COMMIT kestrel`, written by the caller, models' weights left out):
# abtree/before (before all of them), abtree/pdl (PDL only), abtree/qknorm (PDL and the q/k norms); this tree has
# all of them. Stages:
#   moe      batch-1 and batch-8 decode (prompt 128) of the Qwen3-30B-A3B shape: FP8 + FP8 KV in every tree,
#            BF16 in this one and before
#   tests    the GPU tests of the kernels touched, and Qwen3 / Qwen3-MoE / Gemma 3 greedy parity with transformers
#   dense    batch-1 decode of the Llama-3-8B shape, W4A16 group 128 and FP8 + FP8 KV, this tree and before
#   tput     full load (1000 x 1000 in / 1000 out, FP8 + FP8 KV, max_num_seqs 512), Llama-3-8B and Qwen3-30B-A3B
#   profile  the FP8 Qwen3-30B-A3B batch-1 decode step by kernel
source "$(dirname "$0")/h200_job.sh" "$1"; shift
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$out/log.txt"
# Another Hopper GPU runs the H200's tables (copied under its own name in every tree, for this job only).
key=$(python3 -c "from kestrel.kernels.common import gpu_key, device_name; print(gpu_key(device_name(0)))")
if [ "$key" != nvidia_h200 ]; then
  for d in kestrel/kernels/tuning abtree/*/kestrel/kernels/tuning; do
    for f in "$d"/*_nvidia_h200.json; do cp "$f" "${f%_nvidia_h200.json}_$key.json"; done
  done
  echo "the H200 tables copied as $key" | tee -a "$out/log.txt"
fi
arm() { local tree=$1 limit=$2 name=$3; shift 3
  if [ "$tree" = after ]; then latency "$limit" "$name-after" "$@"
  else (cd "abtree/$tree" && PYTHONPATH=$PWD:${PYTHONPATH:-} latency "$limit" "$name-$tree" "$@"); fi; }
qwen=(--arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 2)
llama=(--batch 1 --input-len 128 --output-len 64 --repeats 2)
for stage in "$@"; do
  case $stage in
    moe) for tree in after qknorm pdl before; do
           arm $tree 150 qwen3-30b-a3b-fp8 "${qwen[@]}" --quantization fp8 --kv-cache-dtype fp8; done
         for tree in after before; do arm $tree 150 qwen3-30b-a3b-bf16 "${qwen[@]}"; done ;;
    tests) run 200 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gemv_gpu.py \
             tests/gpu/test_moe_small_t_gpu.py tests/gpu/test_fused_moe_gpu.py tests/gpu/test_cuda_graph_gpu.py \
             tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_wna16_gpu.py tests/kernels/test_rope_kv_kernel.py \
             tests/kernels/test_attention_triton.py tests/kernels/test_moe_small_t.py
           run 120 python3 scripts/gpu_smoke.py --out "$out/smoke" --archs qwen3,qwen3_moe,gemma3 --methods fp8 \
             --skip-engine-checks ;;
    dense) for tree in after before; do arm $tree 120 llama3-8b-w4a16 "${llama[@]}" --weight-only w4a16; done
           for tree in after before; do
             arm $tree 100 llama3-8b-fp8 "${llama[@]}" --quantization fp8 --kv-cache-dtype fp8; done ;;
    tput) for arch in llama3-8b qwen3-30b-a3b; do
            run 280 python3 -m kestrel.bench.throughput --arch $arch --quantization fp8 --kv-cache-dtype fp8 \
              --max-num-seqs 512 --hf-peer-prompts 0 --max-seconds 200 \
              --result-file "$out/throughput-$arch-fp8-1000x1000-h200.json"
          done ;;
    profile) run 150 python3 scripts/h200_decode_profile.py --out "$out" --arch qwen3-30b-a3b --tag fewer-launches \
               --precisions fp8 ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
