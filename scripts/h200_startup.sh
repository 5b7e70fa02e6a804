#!/usr/bin/env bash
# Where the start-up of the Llama-3-8B shape goes on one H200: `scripts/h200_startup.sh OUT STAGE...`.
# Each run builds the engine in a fresh process (`kestrel bench latency`, batch 1, prompt 128) from an empty Triton
# cache of its own unless said otherwise. Stages:
#   profile  FP8 + FP8 KV cold, then cold under cProfile, then warm (the profiled run's cache) under cProfile:
#            cProfile's statistics in OUT/*.prof, functions by cumulative time in OUT/*-prof.txt; then BF16 cold
#   cold     FP8 + FP8 KV and BF16, two cold runs each (tag: $TAG, default `cold`)
#   pyc      `cold` again with Python's bytecode cached under PYTHONPYCACHEPREFIX (filled by a first run), as a
#            pip-installed environment has it: the device's environment has no .pyc files and sets
#            PYTHONDONTWRITEBYTECODE, so each of its processes compiles every module it imports
#   serving  the engine a server builds (`kestrel bench throughput`, 32 prompts of 128 / 16, FP8 + FP8 KV, the
#            128k tokenizer, so the grammar workers start): max_num_seqs 512 cold, then cold and warm under
#            cProfile, then max_num_seqs 128 (the default) cold
#   serving-ab  the `serving` engine's cold start, max_num_seqs 512 (two rounds) and 128 (one), of the working
#            tree against a copy of it with PATCH reversed (a file in the tree, e.g. `git diff BEFORE HEAD -- kestrel >
#            start.patch`), alternated; then the tests of the start-up's compile-ahead and graphs on the GPU (junit
#            XML in OUT)
#   capture-ab  the GPU tests of the capture modes (junit XML in OUT), then the `serving` engine's cold start,
#            max_num_seqs 512 then 128, with its CUDA graphs captured while it serves (`--graph-capture serving`)
#            against all of them before it serves (`startup`, the default), alternated
#   startup-ab  the GPU tests of the compile-ahead and the capture modes (junit XML in OUT), then the `serving`
#            engine's cold start at max_num_seqs 128 (two rounds) and 512 (one): the working tree with its graphs
#            captured while it serves and with them captured at start-up, against a copy with PATCH reversed (as in
#            serving-ab) at its default, alternated
# Everything under OUT is packed into OUT/results.tar.gz at the end (a call brings back 8 files at most).
source "$(dirname "$0")/h200_job.sh" "$1"; shift
h200_tables  # off an H200, its tables copied under the GPU's name: the defaults judged
args=(--batch 1 --input-len 128 --output-len 16 --hf-peer none --no-checks)
fp8=(--quantization fp8 --kv-cache-dtype fp8)
tag=${TAG:-cold}
# bench LIMIT NAME CACHE PROF ARGS...: PROF 1 runs it under cProfile
bench() { local limit=$1 name=$2 cache=$3 prof=$4; shift 4
  local py=(python3); [ "$prof" = 1 ] && py=(python3 -m cProfile -o "$out/$name.prof")
  run "$limit" env TRITON_CACHE_DIR="$cache" "${py[@]}" -m kestrel.bench.latency "${args[@]}" "$@" \
    --result-file "$out/latency-$name-h200.json"
  if [ "$prof" = 1 ] && [ -f "$out/$name.prof" ]; then
    python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(80)" \
      "$out/$name.prof" > "$out/$name-prof.txt"
  fi; }
# cold_start DIR NAME SEQS ARGS...: the serving engine's cold start (`kestrel bench throughput`, 32 prompts of 128 /
# 16, FP8 + FP8 KV, the 128k tokenizer) of the tree at DIR, from an empty Triton cache, with max_num_seqs SEQS
cold_start() { (cd "$1" && run 150 env TRITON_CACHE_DIR="$(mktemp -d)" python3 -m kestrel.bench.throughput \
    --num-prompts 32 --input-len 128 --output-len 16 --hf-peer-prompts 0 --max-num-seqs "$3" "${fp8[@]}" \
    --tokenizer .bench-tokenizer-128k "${@:4}" --result-file "$out/throughput-start-$2-h200.json"); }
# before_tree STAGE: /tmp/before, a copy of the tree with PATCH reversed
before_tree() { [ -f "${PATCH:-}" ] || { echo "$1 needs PATCH=FILE (in the tree)" | tee -a "$out/log.txt"; exit 2; }
  rm -rf /tmp/before && cp -r . /tmp/before && (cd /tmp/before && patch -s -R -p1 < "$PATCH") || exit 1; }
cold_runs() { local tag=$1
  for i in 1 2; do
    bench 150 "fp8-$tag-$i" "$(mktemp -d)" 0 "${fp8[@]}"
    bench 150 "bf16-$tag-$i" "$(mktemp -d)" 0
  done; }
for stage in "$@"; do
  case $stage in
    profile) bench 150 fp8-cold "$(mktemp -d)" 0 "${fp8[@]}"
             cache=$(mktemp -d)
             bench 200 fp8-cold-profiled "$cache" 1 "${fp8[@]}"
             bench 150 fp8-warm-profiled "$cache" 1 "${fp8[@]}"
             bench 150 bf16-cold "$(mktemp -d)" 0 ;;
    cold) cold_runs "$tag" ;;
    serving-ab) before_tree serving-ab
             for job in 512:1 512:2 128:1; do
               seqs=${job%:*} round=${job#*:}
               cold_start . "after-$seqs-$round" "$seqs"
               cold_start /tmp/before "before-$seqs-$round" "$seqs"
             done
             pack_results  # what came so far, should the tests outlast the call
             run 280 python3 -m pytest -q -rf -p no:cacheprovider --junitxml "$out/gpu-tests.xml" \
               tests/gpu/test_compile_ahead_gpu.py tests/gpu/test_cuda_graph_gpu.py ;;
    capture-ab) run 150 python3 -m pytest -q -rf -p no:cacheprovider --junitxml "$out/gpu-tests.xml" \
               tests/gpu/test_cuda_graph_gpu.py -k "serving or matches_eager or kv_scales or async"
             for seqs in 512 128; do
               for round in 1 2; do
                 for mode in serving startup; do cold_start . "$mode-$seqs-$round" "$seqs" --graph-capture "$mode"; done
               done
             done ;;
    startup-ab) before_tree startup-ab
             run 200 python3 -m pytest -q -rf -p no:cacheprovider --junitxml "$out/gpu-tests.xml" \
               tests/gpu/test_compile_ahead_gpu.py tests/gpu/test_cuda_graph_gpu.py \
               -k "compile or serving or matches_eager or kv_scales or async"
             for round in 1 2; do
               cold_start . "serving-128-$round" 128 --graph-capture serving
               cold_start /tmp/before "before-128-$round" 128
               cold_start . "startup-128-$round" 128 --graph-capture startup
             done
             cold_start . serving-512-1 512 --graph-capture serving
             cold_start /tmp/before before-512-1 512 ;;
    serving) tput() { local name=$1 cache=$2 prof=$3 seqs=$4
               local py=(python3); [ "$prof" = 1 ] && py=(python3 -m cProfile -o "$out/$name.prof")
               run 150 env TRITON_CACHE_DIR="$cache" "${py[@]}" -m kestrel.bench.throughput --num-prompts 32 \
                 --input-len 128 --output-len 16 --hf-peer-prompts 0 --max-num-seqs "$seqs" "${fp8[@]}" \
                 --tokenizer .bench-tokenizer-128k --result-file "$out/throughput-start-$name-h200.json"
               if [ "$prof" = 1 ] && [ -f "$out/$name.prof" ]; then
                 python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(120)" \
                   "$out/$name.prof" > "$out/$name-prof.txt"
                 python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(60)" \
                   "$out/$name.prof" > "$out/$name-prof-tottime.txt"
               fi; }
             tput seqs512-cold "$(mktemp -d)" 0 512
             cache=$(mktemp -d)
             tput seqs512-cold-profiled "$cache" 1 512
             tput seqs512-warm-profiled "$cache" 1 512
             tput seqs128-cold "$(mktemp -d)" 0 128 ;;
    pyc) (unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX; PYTHONPYCACHEPREFIX=$(mktemp -d)
          bench 150 "fill-pyc-$tag" "$(mktemp -d)" 0 "${fp8[@]}"
          cold_runs "$tag-pyc") ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
pack_results
