#!/usr/bin/env bash
# GGUF files on the weight-only kernel (issue 28), by stage: `scripts/h200_gguf.sh OUT STAGE...`, the `gguf` package
# installed first (from wheels where the machine has no registry). Every stage appends to OUT/log.txt under its
# own time limit; results are OUT/latency-*-h200.json.
# Stages:
#   tables      the H200's tuning tables copied under this GPU's name when it is another
#   features    the weight-only launch features turned on in this GPU's table (wna16_grouped_layout,
#               wna16_int8_wide, wna16_dense_prompts), for the stages after it
#   tests       the weight-only kernel's tests compiled on the GPU: float offsets (mins) on every path, the one-shot
#               GEMV (int8 in small groups included), bad arguments
#   gemv        scripts/h200_gguf_gemv.py: the decode GEMV in the Q4_K_M forms under each slice layout it can take
#   gguf-MIX    batch-1 and batch-8 decode (prompt 128) of a random Llama-3-8B GGUF file in MIX (q4_k_m, q4_0,
#               q8_0; written on first use), the engine built in an empty Triton cache: `cold-MIX` in the results
#   warm-MIX    the same file again, kernels cached: start-up to a built engine, batch 1
#   startup-MIX where the MIX file's start-up goes: cProfile of building its engine (kernels cached by a gguf-MIX
#               stage before it), the 40 costliest calls by cumulative time in OUT/startup-profile-MIX.txt
#   bf16        the same shape as a BF16 safetensors checkpoint (written on first use), kernels cached after the
#               first of its two runs: `bf16-cold`, `bf16-warm`
#   tput-MIX    full load of the MIX file: 384 prompts x 1000 in / 1000 out at max_num_seqs 256 (a batch drained and
#               refilled; as the W4A16 runs of benchmarks/results/issue28/)
#   w4a16       a compressed-tensors W4A16 (group 128) safetensors checkpoint of the same shape, batch 1 and 8
#   pack        everything under OUT in OUT/results.tar.gz
source "$(dirname "$0")/h200_job.sh" "$1"; shift
cold_cache() { export TRITON_CACHE_DIR="$out/triton-cache-$1"; rm -rf "$TRITON_CACHE_DIR"; }
for stage in "$@"; do
  case $stage in
    tables) h200_tables ;;
    features) for f in wna16_grouped_layout wna16_int8_wide wna16_dense_prompts; do launch_feature $f on; done ;;
    tests) run 120 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_wna16.py -k "mins or invalid or oneshot or dense"
           run 60 python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/gpu/test_wna16_gpu.py -k oneshot ;;
    gemv) run 200 python3 scripts/h200_gguf_gemv.py --out "$out" ;;
    gguf-*) mix=${stage#gguf-}; cold_cache "$mix"
            latency 240 "llama3-8b-gguf-$mix-cold" --weight-only "gguf-$mix" --batch 1,8 --input-len 128 \
              --output-len 64 --repeats 2 ;;
    warm-*) mix=${stage#warm-}; export TRITON_CACHE_DIR="$out/triton-cache-$mix"
            latency 150 "llama3-8b-gguf-$mix-warm" --weight-only "gguf-$mix" --batch 1 --input-len 128 \
              --output-len 32 ;;
    startup-*) mix=${stage#startup-}; export TRITON_CACHE_DIR="$out/triton-cache-$mix"
                run 200 python3 -c "import cProfile, pstats, sys, torch; from kestrel.bench import common
path, _ = common.prepare_model(None, 'llama3-8b', False, None, False, torch.device('cuda'), 'gguf-$mix')
profile = cProfile.Profile(); profile.enable()
engine = common.build_engine(path, dtype='bfloat16', max_model_len=512, max_num_seqs=8)
profile.disable(); print(f'engine built in {engine.build_s:.1f} s')
pstats.Stats(profile, stream=sys.stdout).sort_stats('cumulative').print_stats(40)" > "$out/startup-profile-$mix.txt" ;;
    bf16) cold_cache bf16
          run 200 python3 -c "import torch; from pathlib import Path; from kestrel.bench import common;
common.write_random_checkpoint(Path('/tmp/kestrel-bench-llama3-8b'), common.ARCHS['llama3-8b'], torch.device('cuda'))"
          latency 150 llama3-8b-bf16-cold --batch 1 --input-len 128 --output-len 32
          latency 150 llama3-8b-bf16-warm --batch 1 --input-len 128 --output-len 32 ;;
    tput-*) mix=${stage#tput-}
            run 240 python3 -m kestrel.bench.throughput --weight-only "gguf-$mix" --hf-peer-prompts 0 \
              --num-prompts 384 --input-len 1000 --output-len 1000 --max-num-seqs 256 --max-seconds 150 \
              --result-file "$out/throughput-llama3-8b-gguf-$mix-h200.json" ;;
    w4a16) latency 200 llama3-8b-w4a16-g128 --weight-only w4a16 --batch 1,8 --input-len 128 --output-len 64 \
             --repeats 2 ;;
    pack) rm -rf "$out"/triton-cache-*; pack_results ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
