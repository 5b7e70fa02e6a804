#!/usr/bin/env bash
# The decode GEMV on one H200, by stage: `scripts/h200_gemv.sh OUT STAGE...`.
# Every stage writes its JSON under OUT and appends to OUT/log.txt, each step under its own time limit.
# Stages:
#   tests    the GEMV's kernel and GPU tests compiled on the GPU
#   sweep    scripts/h200_gemv.py: candidates against cuBLAS / W8A8 -> OUT/gemv_nvidia_h200.json
#   before   batch-1 and batch-8 decode (prompt 128) of the Llama-3-8B shape, BF16 and FP8 + FP8 KV, and of the
#            Qwen3-30B-A3B shape in FP8 + FP8 KV, without a GEMV table (the committed one is set aside; tag `before`)
#   table    the sweep's OUT/gemv_nvidia_h200.json, else the committed table set aside by `before`, put in
#            kestrel/kernels/tuning/ (the path on where it won)
#   after    the `before` runs again (tag `after`)
#   moe      the Qwen3-30B-A3B shape alone, BF16 and FP8 + FP8 KV, batch 1 and 8: without the table, then with it
#   tput     full load: 1000 x 1000 in / 1000 out, FP8 + FP8 KV, max_num_seqs 512, Qwen3-30B-A3B and Llama-3-8B
#            shapes, with the table (the check a default needs)
#   gputests tests/gpu: the GEMV's, CUDA graphs' and prefill graphs' (drain and refill) GPU tests
#   tables   the H200's tuning tables copied under this GPU's name (an H100 runs them as the H200 would)
#   sweep-fp8   the sweep of the FP8 weights alone
#   sweep-w16-llama   the 16-bit sweep at Llama-3-8B's shapes, 1 and 2 rows
#   merge-fp8 / merge-w16   this GPU's table: the entries of the shapes the sweep measured replaced by its winners
#            (dropped where none won), the rest kept (the table before the first merge kept as
#            OUT/committed-table.json)
#   fp8-before / fp8-after   Llama-3-8B FP8 + FP8 KV decode at batch 1, 4 and 8 (prompt 128)
#   bf16-before / bf16-after   Llama-3-8B BF16 batch-1 decode (prompt 128)
#   profile-TAG   Llama-3-8B FP8 + FP8 KV batch-1 decode step, kernel by kernel (scripts/h200_decode_profile.py;
#            PDL off, so each kernel's own time is what the profiler shows)
#   pack     everything under OUT in OUT/results.tar.gz
source "$(dirname "$0")/h200_job.sh" "$1"; shift
decode_runs() { local tag=$1
  latency 150 llama3-8b-bf16-$tag --batch 1,8 --input-len 128 --output-len 64 --repeats 2
  latency 150 llama3-8b-fp8-$tag --batch 1,8 --input-len 128 --output-len 64 --repeats 2 \
    --quantization fp8 --kv-cache-dtype fp8
  latency 200 qwen3-30b-a3b-fp8-$tag --arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 2 \
    --quantization fp8 --kv-cache-dtype fp8; }
for stage in "$@"; do
  case $stage in
    tests) run 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv_gpu.py tests/kernels/test_gemv.py ;;
    sweep) run 420 python3 scripts/h200_gemv.py --out "$out" ;;
    before) mv -f kestrel/kernels/tuning/gemv_nvidia_h200.json "$out/committed-table.json" 2>/dev/null
            decode_runs before ;;
    table) src="$out/gemv_nvidia_h200.json"; [ -f "$src" ] || src="$out/committed-table.json"
           cp "$src" kestrel/kernels/tuning/gemv_nvidia_h200.json && echo "table in place: $src" | tee -a "$out/log.txt" ;;
    after) decode_runs after ;;
    moe) mv -f kestrel/kernels/tuning/gemv_nvidia_h200.json "$out/committed-table.json"
         for tag in before after; do
           [ $tag = after ] && cp "$out/committed-table.json" kestrel/kernels/tuning/gemv_nvidia_h200.json
           latency 200 qwen3-30b-a3b-bf16-$tag --arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 \
             --repeats 2
           latency 200 qwen3-30b-a3b-fp8-$tag --arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 \
             --repeats 2 --quantization fp8 --kv-cache-dtype fp8
         done ;;
    tput) for arch in qwen3-30b-a3b llama3-8b; do
            run 280 python3 -m kestrel.bench.throughput --arch $arch --quantization fp8 --kv-cache-dtype fp8 \
              --max-num-seqs 512 --hf-peer-prompts 0 --max-seconds 200 \
              --result-file "$out/throughput-$arch-fp8-1000x1000-gemv-h200.json"
          done ;;
    gputests) run 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv_gpu.py \
                tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_prefill_graphs_gpu.py ;;
    tables) h200_tables ;;
    sweep-fp8) run 420 python3 scripts/h200_gemv.py --out "$out" --kinds fp8 ;;
    sweep-w16-llama) run 300 python3 scripts/h200_gemv.py --out "$out" --kinds w16 --arch llama3-8b --tokens 1,2 ;;
    merge-fp8|merge-w16) [ -n "${key:-}" ] || h200_tables
               [ -f "$out/committed-table.json" ] || cp "$tuning/gemv_$key.json" "$out/committed-table.json"
               python3 - "$tuning/gemv_$key.json" "$out/gemv-h200.json" "$out/gemv_$key.json" <<'PY' | tee -a "$out/log.txt"
import json, sys
table_path, sweep_path, swept_path = sys.argv[1:4]
table, sweep, swept = (json.load(open(p)) for p in sys.argv[1:4])
# Every shape the sweep timed loses its entry (one its time budget left untimed keeps it); the shapes where a
# candidate won get the sweep's.
measured = {f"{r['kind']}:{r['N']},{r['K']}" for r in sweep["rows"] if any(c.get("us") for c in r["candidates"])}
configs = {k: v for k, v in table["configs"].items() if k not in measured}
configs.update(swept["configs"])
json.dump(dict(table, configs=configs), open(table_path, "w"), indent=1)
print("table in place:", json.dumps(configs))
PY
               ;;
    bf16-before|bf16-after) latency 120 "llama3-8b-bf16-${stage#bf16-}" --batch 1 --input-len 128 --output-len 64 \
                              --repeats 3 ;;
    fp8-before|fp8-after) latency 150 "llama3-8b-fp8-${stage#fp8-}" --batch 1,4,8 --input-len 128 --output-len 64 \
                            --repeats 2 --quantization fp8 --kv-cache-dtype fp8 ;;
    profile-*) run 200 python3 scripts/h200_decode_profile.py --out "$out" --arch llama3-8b --precisions fp8 \
                 --no-pdl --tag "${stage#profile-}" ;;
    pack) pack_results ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
