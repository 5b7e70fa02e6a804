#!/usr/bin/env bash
# The targets judged on the H200, re-measured on whichever GPU comes, by stage:
# `scripts/h200_judged.sh OUT STAGE...` (each stage's results under OUT, its log in OUT/log.txt). Stages:
#   tests      the CUDA-graph, prefill-graph, verify-graph, staged-KV and token-bitmask GPU tests
#   hoststep   `kestrel bench host-step` at batch 256 (core deltas), the working tree against BEFORE (a commit)
#              alternated when BEFORE is set, else the working tree alone
#   tput       the FP8 + FP8 KV full load, 1000 x 1000 in / 1000 out, max_num_seqs 512
#   tputgw     the same full load with the engine's grammar backend built on the 128k tokenizer and its default
#              grammar workers: the run a default of grammar workers on a GPU needs
#   gwtests    the grammar workers' tests and the async engine's drained-and-refilled batches, on the GPU
#              (needs xgrammar with apache-tvm-ffi and pydantic (pydantic-core, annotated-types, typing-inspection,
#              typing-extensions), jsonschema with its dependencies, as cp312 wheels in .whl)
#   structured `kestrel bench structured` at batch 64, the engine's default grammar workers and none
#   decode1    Llama-3-8B batch-1 decode, prompt 128, BF16 and FP8 + FP8 KV
#   ttft       batch-1 TTFT of an 8k and a 128-token FP8 prompt
#   moe        `kestrel bench moe` at T = 32, 128: bf16, FP8 per channel, FP8 [128, 128] blocks
#   moe1       Qwen3-30B-A3B batch-1 and batch-8 decode, BF16 and FP8 + FP8 KV
#   mixtral    Mixtral-8x7B decode at batch 1, 8, 32, 128, FP8 + FP8 KV (and BF16 where its 93 GB fit the GPU)
#   moetput    Qwen3-30B-A3B full load, BF16, 1000 x 1000 in / 1000 out, max_num_seqs 512
#   w8a16      Llama-3-8B W8A16 (group 128): decode at batch 1, 8, 32, 128, and a full load of 384 x 1000/1000
#   blockfp8   block-FP8 dense layers weight-only against the W8A8 block GEMM (and W8A8 per channel), Llama-3-8B's
#              linears, M = 1-8192 (scripts/h200_block_fp8_mm.py), after the block GEMM's kernel tests on the GPU
#   sweep8     the 8-bit weight-only tiles (int8 and FP8 in groups of 128, the dense path from 128 rows), M = 1-4096
#              (scripts/h200_wna16_8bit_sweep.py): OUT/wna16-8bit-entries.json is the candidate "N,K,TYPE" entries
#   dense8     FP8 weights in groups of 128 from 128 rows (the dense path a candidate): the sweep at M = 128-4096,
#              the block-FP8 layers weight-only before and after its entries are merged into this GPU's table
#              (OUT/wna16_nvidia_h200.json: the committed H200 table with them), then the table-driven GPU tests
#   blocksweep the W8A8 block GEMM's tiles (scripts/h200_block_fp8_sweep.py, M = 1-8192 at the 8B shapes): the
#              block-FP8 layers timed before and after this GPU's table takes the sweep's best configs
#              (OUT/block_fp8_mm_<gpu>.json), then the block GEMM's kernel tests on the GPU
#   startgw    start-up to first token from an empty Triton cache, FP8 + FP8 KV, 32 prompts of 128 / 16 on the 128k
#              tokenizer (the grammar workers' fork server started), default grammar workers and none, alternated
# Off an H200 the H200's tables are copied under the GPU's name (h200_tables), so the defaults are the H200's.
source "$(dirname "$0")/h200_job.sh" "$1"; shift
h200_tables
nproc | tee -a "$out/log.txt"
for stage in "$@"; do
  case $stage in
    tests) run 240 python3 -m pytest -q -rf -p no:cacheprovider -n 4 tests/gpu/test_cuda_graph_gpu.py \
             tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_verify_graphs_gpu.py \
             tests/gpu/test_prefill_staged_kv_gpu.py tests/gpu/test_token_bitmask_gpu.py ;;
    hoststep) hs=(--tokenizer .bench-tokenizer-128k --batch 256 --output-len 256 --repeats 3 --core-deltas --clock cpu
                  --modes unconstrained)
              if [ -n "${BEFORE:-}" ]; then
                run 200 python3 scripts/host_step_ab.py --before "$BEFORE" --rounds 4 \
                  --out "$out/host-step-ab-gpu-host.json" -- "${hs[@]}"
              else
                run 100 python3 -m kestrel.bench.host_step "${hs[@]}"
              fi ;;
    tput) full_load_fp8 judged ;;
    tputgw) run 330 python3 -m kestrel.bench.throughput --num-prompts 1000 --input-len 1000 --output-len 1000 \
              --hf-peer-prompts 0 --max-seconds 280 --max-num-seqs 512 --quantization fp8 --kv-cache-dtype fp8 \
              --tokenizer .bench-tokenizer-128k \
              --result-file "$out/throughput-fp8-1000x1000-512-grammar-workers-default-h200.json" ;;
    gwtests) run 300 python3 -m pytest -q -rf -p no:cacheprovider tests/unit/test_grammar_workers_default.py \
               tests/e2e/test_grammar_workers.py \
               tests/e2e/test_async_scheduling.py ;;
    structured) for workers in default 0; do
                  flag=(); [ "$workers" = default ] || flag=(--grammar-workers "$workers")
                  run 200 python3 -m kestrel.bench.structured --tokenizer .bench-tokenizer-128k --batch 64 \
                    --output-len 96 --repeats 2 "${flag[@]}" --result-file "$out/structured-b64-workers-$workers-h200.json"
                done ;;
    decode1) latency 120 decode1-bf16 --batch 1 --input-len 128 --output-len 64 --repeats 3
             latency 120 decode1-fp8 --batch 1 --input-len 128 --output-len 64 --repeats 3 \
               --quantization fp8 --kv-cache-dtype fp8 ;;
    ttft) ttft_fp8_pair judged ;;
    moe) run 150 python3 -m kestrel.bench.moe --batch 32,128 --anchors none --result-dir "$out" --name moe-bf16
         run 150 python3 -m kestrel.bench.moe --batch 32,128 --anchors none --dtype fp8 --fp8-block channel \
           --result-dir "$out" --name moe-fp8-channel
         run 150 python3 -m kestrel.bench.moe --batch 32,128 --anchors none --dtype fp8 --fp8-block 128,128 \
           --result-dir "$out" --name moe-fp8-block ;;
    moe1) latency 200 moe1-fp8 --arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 3 \
            --quantization fp8 --kv-cache-dtype fp8
          latency 200 moe1-bf16 --arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 3 ;;
    mixtral) latency 300 mixtral-fp8 --arch mixtral-8x7b --batch 1,8,32,128 --input-len 128 --output-len 64 \
               --repeats 2 --quantization fp8 --kv-cache-dtype fp8
             gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
             if [ "$gib" -gt 120000 ]; then
               latency 300 mixtral-bf16 --arch mixtral-8x7b --batch 1,8,32,128 --input-len 128 --output-len 64 \
                 --repeats 2
             else
               echo "Mixtral-8x7B BF16 (93 GB of weights) does not fit this GPU's $gib MiB" | tee -a "$out/log.txt"
             fi ;;
    moetput) run 400 python3 -m kestrel.bench.throughput --arch qwen3-30b-a3b --num-prompts 1000 --input-len 1000 \
               --output-len 1000 --hf-peer-prompts 0 --max-seconds 330 --max-num-seqs 512 \
               --result-file "$out/throughput-qwen3-30b-a3b-bf16-judged-h200.json" ;;
    w8a16) latency 200 llama3-8b-w8a16 --weight-only w8a16 --batch 1,8,32,128 --input-len 128 --output-len 64 \
             --repeats 2
           run 300 python3 -m kestrel.bench.throughput --weight-only w8a16 --hf-peer-prompts 0 --num-prompts 384 \
             --input-len 1000 --output-len 1000 --max-num-seqs 256 --max-seconds 240 \
             --result-file "$out/throughput-llama3-8b-w8a16-384x1000-256-h200.json" ;;
    blockfp8) run 200 python3 -m pytest -q -rf -p no:cacheprovider tests/kernels/test_block_fp8_mm.py
              PYTHONPATH=. run 300 python3 scripts/h200_block_fp8_mm.py --out "$out" ;;
    dense8) ms=128,256,1024,4096
            PYTHONPATH=. run 260 python3 scripts/h200_wna16_8bit_sweep.py --out "$out" --types fp8_e4m3 --ms $ms \
              --max-seconds 200
            mkdir -p "$out/before" "$out/after"
            PYTHONPATH=. run 150 python3 scripts/h200_block_fp8_mm.py --out "$out/before" --ms 1,64,$ms,8192
            python3 scripts/merge_wna16_entries.py "$tuning/wna16_nvidia_h200.json" "$out/wna16-8bit-entries.json" \
              --ms $ms --out "$out/wna16_nvidia_h200.json" | tee -a "$out/log.txt"
            python3 scripts/merge_wna16_entries.py "$tuning/wna16_$key.json" "$out/wna16-8bit-entries.json" --ms $ms \
              | tee -a "$out/log.txt"
            PYTHONPATH=. run 150 python3 scripts/h200_block_fp8_mm.py --out "$out/after" --ms 1,64,$ms,8192
            run 150 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_wna16_gpu.py -k "8bit or every_weight_type" ;;
    blocksweep) mkdir -p "$out/before" "$out/after"
                PYTHONPATH=. run 150 python3 scripts/h200_block_fp8_mm.py --out "$out/before" --ms 1,64,256,1024,4096,8192
                PYTHONPATH=. run 330 python3 scripts/h200_block_fp8_sweep.py --out "$out" --max-seconds 260
                cp "$out/block_fp8_mm_$key.json" "$tuning/" && echo "table: block_fp8_mm_$key.json" | tee -a "$out/log.txt"
                PYTHONPATH=. run 150 python3 scripts/h200_block_fp8_mm.py --out "$out/after" --ms 1,64,256,1024,4096,8192
                run 150 python3 -m pytest -q -rf -p no:cacheprovider --junitxml "$out/block-tests.xml" \
                  tests/kernels/test_block_fp8_mm.py ;;
    startgw) for round in 1 2; do
               for workers in default 0; do
                 flag=(); [ "$workers" = default ] || flag=(--grammar-workers "$workers")
                 run 150 env TRITON_CACHE_DIR="$(mktemp -d)" python3 -m kestrel.bench.throughput --num-prompts 32 \
                   --input-len 128 --output-len 16 --hf-peer-prompts 0 --max-num-seqs 512 --quantization fp8 \
                   --kv-cache-dtype fp8 --tokenizer .bench-tokenizer-128k "${flag[@]}" \
                   --result-file "$out/throughput-start-workers-$workers-$round-h200.json"
               done
             done ;;
    sweep8) PYTHONPATH=. run 400 python3 scripts/h200_wna16_8bit_sweep.py --out "$out" --max-seconds 330 ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
pack_results
