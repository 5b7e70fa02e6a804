#!/usr/bin/env bash
# The worker-side proposers on one H200 (under 2 minutes): `kestrel bench spec-decode` at batch 1 on held-out code
# prompts with the shipped kestrel-tiny draft model and EAGLE head (k = 2, 4) against no speculation; no n-gram
# sweep, no verification-cost sweep. Writes OUT/spec-models-h200.json and .png. Usage: scripts/h200_spec_models.sh OUT
set -euo pipefail
out=$1
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
python3 -m kestrel.bench.spec_decode --skip-ngram --skip-verify-sweep --model-k 2,4 --prompt-len 200 \
  --output-len 256 --draft-model kestrel/models/kestrel-tiny-draft --eagle-head kestrel/models/kestrel-tiny-eagle \
  --result-file "$out/spec-models-h200.json" 2>&1 | tail -30
