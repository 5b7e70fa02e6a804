#!/usr/bin/env bash
# Fewer and overlapped launches on the decode path, in one job: `scripts/h200_pdl.sh OUT`. Programmatic dependent
# launch, the q/k norms in the RoPE launch, the split-KV merge and the MoE k-sum by last arrival. Earlier code lies
# in abtree/<tag>/kestrel (`git archive COMMIT kestrel`, written by the caller, models' weights left out):
# abtree/before (before all of them), abtree/pdl (PDL only), abtree/qknorm (PDL and the q/k norms); this tree has
# all of them.
# Batch-1 and batch-8 decode (prompt 128) of the Qwen3-30B-A3B shape (FP8 + FP8 KV, BF16), the GPU tests of the
# kernels touched, Qwen3 and Gemma 3 parity with transformers, then batch 1 of the Llama-3-8B shape (W4A16 group
# 128, FP8 + FP8 KV) and a kernel profile of the FP8 MoE step.
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
here=$PWD
arm() { local tree=$1 limit=$2 name=$3; shift 3
  if [ "$tree" = after ]; then latency "$limit" "$name-after" "$@"
  else (cd "abtree/$tree" && PYTHONPATH=$PWD:${PYTHONPATH:-} latency "$limit" "$name-$tree" "$@"); fi; }
qwen=(--arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 2)
for tree in after qknorm pdl before; do arm $tree 150 qwen3-30b-a3b-fp8 "${qwen[@]}" --quantization fp8 --kv-cache-dtype fp8; done
for tree in after before; do arm $tree 150 qwen3-30b-a3b-bf16 "${qwen[@]}"; done
run 200 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gemv_gpu.py tests/gpu/test_moe_small_t_gpu.py \
  tests/gpu/test_fused_moe_gpu.py tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_prefill_graphs_gpu.py \
  tests/gpu/test_wna16_gpu.py tests/kernels/test_rope_kv_kernel.py tests/kernels/test_attention_triton.py
run 120 python3 scripts/gpu_smoke.py --out "$out/smoke" --archs qwen3,qwen3_moe,gemma3 --methods fp8 --skip-engine-checks
for tree in after before; do arm $tree 120 llama3-8b-w4a16 --batch 1 --input-len 128 --output-len 64 --repeats 2 \
  --weight-only w4a16; done
for tree in after before; do arm $tree 100 llama3-8b-fp8 --batch 1 --input-len 128 --output-len 64 --repeats 2 \
  --quantization fp8 --kv-cache-dtype fp8; done
run 150 python3 scripts/h200_decode_profile.py --out "$out" --arch qwen3-30b-a3b --tag pdl-qknorm --precisions fp8
