#!/usr/bin/env bash
# The 8k FP8 prefill's memory-bound launches (RoPE + K/V staging, the activation quantizers) on one GPU:
# `scripts/h200_prefill_small_kernels.sh OUT STAGE...`, with OLD_ROPE_KV=FILE another version of kernels/rope_kv.py
# and BEFORE="PATH=FILE ..." / MID="PATH=FILE ..." files of other versions to run in place of this tree's.
#   micro     scripts/h200_prefill_small_kernels.py (rope_store_kv against OLD_ROPE_KV; the quantizer's launch shapes)
#   tests     the rope/KV, quantizer and attention kernel tests and the staged-KV GPU tests compiled on the GPU
#             (TESTS="FILE ..." for others)
#   profile   scripts/h200_prefill_profile.py, FP8 + FP8 KV, 8k prompt, into OUT/profile/
#   ttft      `kestrel bench latency` batch 1, FP8 + FP8 KV, 8k prompt (into OUT/latency-ttft8k-fp8-TAG-h200.json)
#   ttft10    the same, 10 repeats
#   ttft128   `kestrel bench latency` batch 1, FP8 + FP8 KV, 128-token prompt, 10 repeats
#   tput      full load, 1000 x 1000 in / 1000 out, FP8 + FP8 KV, max_num_seqs 512 (`full_load_fp8`)
#   scores-on, scores-off   launch feature fp8_dots_scores_in_exp on / off in this GPU's table (TAG "scores-on" /
#             "scores-off")
#   clocks    the SM clock, power and throttle reasons every 100 ms from here on, into OUT/clocks.csv
#   before, mid, after   BEFORE's (or MID's) files put in place (TAG "before" / "mid"), this tree's put back
#             (TAG "after"; where `tests` failed, MID's files stand in for this tree's)
#   pack      everything under OUT in OUT/results.tar.gz
source "$(dirname "$0")/h200_job.sh" "$1"; shift
h200_tables
tag=after n=0
for stage in "$@"; do
  echo "-- $stage at $(date +%T.%N)" | tee -a "$out/log.txt"
  case $stage in
    micro) run 300 python3 scripts/h200_prefill_small_kernels.py --out "$out" ${OLD_ROPE_KV:+--old-rope-kv "$OLD_ROPE_KV"} ;;
    tests) run 300 python3 -m pytest -p no:cacheprovider -q -rf ${TESTS:-tests/kernels/test_rope_kv_kernel.py \
             tests/kernels/test_quant_act.py tests/gpu/test_prefill_staged_kv_gpu.py \
             tests/kernels/test_attention_triton.py tests/kernels/test_image_attention.py} 2>&1 | tail -8
          # a failure puts MID's files in place of this tree's for the later "after" stages
          if [ "${PIPESTATUS[0]}" != 0 ] && [ -n "${MID:-}" ]; then
            echo "tests failed: MID's files stand in for this tree's" | tee -a "$out/log.txt"
            for pair in $MID; do cp "${pair#*=}" "${pair%%=*}"; done
          fi ;;
    mid) tag=mid; mkdir -p /tmp/this-tree
          for pair in $MID; do cp "${pair%%=*}" "/tmp/this-tree/$(basename "${pair%%=*}")"; cp "${pair#*=}" "${pair%%=*}"; done ;;
    profile) prefill_profile_fp8 "profile-$tag" ;;
    ttft) n=$((n + 1)); latency 150 "ttft8k-fp8-$tag-$n" --batch 1 --input-len 8192 --output-len 16 --repeats 3 \
            --warmups 1 --quantization fp8 --kv-cache-dtype fp8 ;;
    ttft10) n=$((n + 1)); latency 200 "ttft8k-fp8-$tag-$n" --batch 1 --input-len 8192 --output-len 16 \
            --repeats 10 --warmups 1 --quantization fp8 --kv-cache-dtype fp8 ;;
    ttft128) latency 150 "ttft128-fp8-$tag" --batch 1 --input-len 128 --output-len 8 --repeats 10 --warmups 2 \
            --quantization fp8 --kv-cache-dtype fp8 ;;
    tput) full_load_fp8 "$tag" ;;
    clocks) nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
              --format=csv -lms 100 > "$out/clocks.csv" & ;;
    scores-on|scores-off) tag=$stage; launch_feature fp8_dots_scores_in_exp "${stage#scores-}" ;;
    before) tag=before; mkdir -p /tmp/this-tree
          for pair in $BEFORE; do cp "${pair%%=*}" "/tmp/this-tree/$(basename "${pair%%=*}")"; cp "${pair#*=}" "${pair%%=*}"; done ;;
    after) tag=after
          for pair in $BEFORE $MID; do
            saved="/tmp/this-tree/$(basename "${pair%%=*}")"; [ -f "$saved" ] && cp "$saved" "${pair%%=*}"; done ;;
    pack) pack_results ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
echo "-- done at $(date +%T)" | tee -a "$out/log.txt"
kill %1 2>/dev/null || true
