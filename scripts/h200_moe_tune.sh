#!/usr/bin/env bash
# The fused MoE kernel's tuning table per weight kind on one GPU: `scripts/h200_moe_tune.sh OUT STAGE...`.
# Another Hopper GPU runs (and tunes) the H200's tables under its own name. Stages:
#   tune     scripts/tune_fused_moe.py over Qwen3-30B-A3B and Mixtral-8x7B, bf16 / FP8 per channel / FP8 blocks,
#            T = 8, 32, 128, 512: today's config against the chosen one in the same run (OUT/fused_moe_<gpu>.json)
#   moe      `kestrel bench moe` of both shapes at T = 8, 32, 128, 512 with the tree's tables: bf16, FP8 per
#            channel, FP8 blocks of [128, 128] (time against reading each chosen expert once), in OUT/moe.tar.gz
#   tests    the fused MoE and small-T GPU tests
#   latency  Qwen3-30B-A3B FP8 + FP8 KV decode at batch 8, 32, 128 (prompt 128)
#   tput-before, tput-moe  full load, 1000 prompts x 1000 in / 1000 out, FP8 + FP8 KV, max_num_seqs 512, Qwen3-30B-A3B,
#            under the table before the tuning (benchmarks/results/issue27/moe-tune/fused_moe_before.json) / the tree's
source "$(dirname "$0")/h200_job.sh" "$1"; shift
h200_tables
tuned=$(mktemp); cp $tuning/fused_moe_$key.json "$tuned"
moe_table() { cp "$1" $tuning/fused_moe_$key.json; echo "fused MoE table: $1" | tee -a "$out/log.txt"; }
for stage in "$@"; do
  case $stage in
    tune) run 570 python3 scripts/tune_fused_moe.py --out "$out" --tokens 8,32,128,512 --max-seconds 470 ;;
    moe) mkdir -p "$out/moe"
         for kind in bf16 channel 128,128; do
           weights=(--dtype fp8 --fp8-block $kind); name=moe-fp8-${kind/,/x}-h200
           [ $kind = bf16 ] && weights=(--dtype bf16) && name=moe-bf16-h200
           run 200 python3 -m kestrel.bench.moe "${weights[@]}" --batch 8,32,128,512 --anchors none \
             --result-dir "$out/moe" --name $name; done
         tar -czf "$out/moe.tar.gz" -C "$out" moe && rm -rf "$out/moe" ;;
    tests) run 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_moe_gpu.py \
             tests/gpu/test_moe_small_t_gpu.py ;;
    latency) latency 200 qwen3-30b-a3b-fp8-b8-128 --arch qwen3-30b-a3b --batch 8,32,128 --input-len 128 \
               --output-len 64 --repeats 2 --quantization fp8 --kv-cache-dtype fp8 ;;
    tput-before|tput-moe) tag=moe-tuned; moe_table "$tuned"
          [ $stage = tput-before ] && tag=moe-before && moe_table benchmarks/results/issue27/moe-tune/fused_moe_before.json
          run 280 python3 -m kestrel.bench.throughput --arch qwen3-30b-a3b --quantization fp8 \
            --kv-cache-dtype fp8 --max-num-seqs 512 --num-prompts 1000 --hf-peer-prompts 0 --max-seconds 200 \
            --result-file "$out/throughput-qwen3-30b-a3b-fp8-$tag-h200.json"; moe_table "$tuned" ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
