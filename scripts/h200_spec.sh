#!/usr/bin/env bash
# Speculative decoding on one H200 (under 9 minutes): trains an EAGLE-style head and a 2-layer draft model for
# kestrel-tiny (bounded by wall clock), then `kestrel bench spec-decode` at batch 1 on held-out code prompts: no
# speculation, n-gram (k sweep), the draft model and the head (k = 2, 4), and the Llama-3-8B-shape verification
# cost sweep k = 1..8 (CUDA graphs). Writes under OUT: eagle-kestrel-tiny/ and draft-kestrel-tiny/ (each with
# train_log.json: held-out acceptance), spec-decode-h200.json and .png. Usage: scripts/h200_spec.sh OUT
set -euo pipefail
out=$1
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
python3 scripts/train_eagle_tiny.py --kind eagle --device cuda --minutes 2.0 --steps 4000 \
  --out "$out/eagle-kestrel-tiny" 2>&1 | tail -30
python3 scripts/train_eagle_tiny.py --kind draft --device cuda --minutes 1.5 --steps 4000 \
  --out "$out/draft-kestrel-tiny" 2>&1 | tail -30
python3 -m kestrel.bench.spec_decode --k 1,2,4,6 --model-k 2,4 --prompt-len 200 --output-len 256 \
  --draft-model "$out/draft-kestrel-tiny" --eagle-head "$out/eagle-kestrel-tiny" \
  --result-file "$out/spec-decode-h200.json" 2>&1 | tail -30
