#!/usr/bin/env bash
# Prefill graphs and MoE routing on one H200, by stage: `scripts/h200_prefill_moe.sh OUT STAGE...`.
# Every stage writes its JSON (+ PNG) under OUT and appends to OUT/log.txt, each step under its own time limit.
# Stages:
#   tests        tests/gpu, then the kernel tests of the newest kernels compiled on the GPU (MoE routing,
#                Quest, prefill-graph and image attention, paged attention with causal ends)
#   ttft         TTFT of a 128-token prompt at batch 1 (Llama-3-8B shape), BF16 and FP8 + FP8 KV, eager prefill
#                vs prefill graphs (max_prefill_graph_tokens 512)
#   moe-latency  batch 1, 8, 32, 128 decode (prompt 128) of the Qwen3-30B-A3B shape, BF16 and FP8 + FP8 KV
#   tput-graphs  full load: 1000 x 1000 in / 1000 out, FP8 + FP8 KV, max_num_seqs 512, eager prefill vs prefill
#                graphs (max_prefill_graph_tokens 512), one job (the check a default change needs)
source "$(dirname "$0")/h200_job.sh" "$1"; shift
for stage in "$@"; do
  case $stage in
    tests) run 200 python3 -m pytest -q -p no:cacheprovider tests/gpu
           run 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_decode.py \
             tests/kernels/test_prefill_graph_attention.py tests/kernels/test_image_attention.py \
             "tests/kernels/test_fused_moe.py::test_single_program_align_equals_torch_sort" \
             "tests/kernels/test_fused_moe.py::test_route_topk_matches_float64" \
             "tests/kernels/test_fused_moe.py::test_route_topk_ties_take_the_lowest_index" \
             tests/kernels/test_attention_triton.py ;;
    ttft) for p in bf16 fp8; do
            q=(); [ $p = fp8 ] && q=(--quantization fp8 --kv-cache-dtype fp8)
            latency 120 ttft128-$p-eager --batch 1 --input-len 128 --output-len 16 --repeats 5 "${q[@]}"
            latency 150 ttft128-$p-graphs --batch 1 --input-len 128 --output-len 16 --repeats 5 "${q[@]}" \
              --max-prefill-graph-tokens 512
          done ;;
    moe-latency) latency 200 qwen3-30b-a3b-bf16-routing --arch qwen3-30b-a3b --batch 1,8,32,128 --input-len 128 \
                   --output-len 128 --repeats 2
                 latency 200 qwen3-30b-a3b-fp8-routing --arch qwen3-30b-a3b --batch 1,8,32,128 --input-len 128 \
                   --output-len 128 --repeats 2 --quantization fp8 --kv-cache-dtype fp8 ;;
    tput-graphs) for g in 0 512; do
                   run 240 python3 -m kestrel.bench.throughput --quantization fp8 --kv-cache-dtype fp8 \
                     --max-num-seqs 512 --hf-peer-prompts 0 --max-seconds 150 --max-prefill-graph-tokens $g \
                     --result-file "$out/throughput-fp8-1000x1000-prefill-graphs-$g-h200.json"
                 done ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
