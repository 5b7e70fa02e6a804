#!/usr/bin/env bash
# `kestrel bench quant-checkpoint` on one H200 as a detached job, which can outlast one device call:
# `scripts/h200_quant_checkpoint.sh OUT WAIT_S [suite flags]` starts the job unless it is running or ran, waits up
# to WAIT_S seconds for it, then copies its result (partial while it runs) and log under OUT.
set -uo pipefail
out=$1; wait_s=$2; shift 2
work=/tmp/kestrel-quant-checkpoint
mkdir -p "$work" "$out"
if [ ! -f "$work/pid" ]; then
  PYTHONUNBUFFERED=1 setsid nohup python3 -m kestrel.bench.quant_checkpoint --weights-dir "$work/float" \
    --result-file "$work/quant-checkpoint-h200.json" "$@" > "$work/log.txt" 2>&1 &
  echo $! > "$work/pid"
fi
pid=$(cat "$work/pid")
end=$((SECONDS + wait_s))
while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
if kill -0 "$pid" 2>/dev/null; then echo "job still running"; else echo "job finished"; fi
cp "$work"/*.json "$work"/*.png "$work/log.txt" "$out"/ 2>/dev/null
grep -v '^USDT' "$work/log.txt" | tail -40
