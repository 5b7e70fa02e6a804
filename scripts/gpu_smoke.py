"""GPU check of the whole engine: greedy kestrel (Triton attention, W8A8 GEMMs) against HF transformers.

    python scripts/gpu_smoke.py --out DIR

Writes DIR/gpu-smoke.json: per architecture (each family of `kestrel model-init`), greedy token agreement with
transformers over 16 mixed-length prompts (float32 and bfloat16), the same through FP8 and INT8 W8A8, and the
benchmark scripts' own checks
(`kestrel.bench.checks`: the trained kestrel-tiny vs transformers, CUDA graphs vs eager).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.bench import checks  # noqa: E402
from kestrel.init_configs import ARCHS  # noqa: E402
from kestrel.loader.model_init import write_tiny_checkpoint  # noqa: E402

# Checkpoint variants by name: (arch, config overrides). The mixed-window Qwen2 has two KV-cache groups.
VARIANTS = {"qwen2-mixed-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 16,
                                             "max_window_layers": 1})}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--archs", default=",".join([*ARCHS, *VARIANTS]))
    parser.add_argument("--dtypes", default="float32,bfloat16", help="of the parity checks against transformers")
    parser.add_argument("--methods", default="fp8,int8", help="W8A8 methods checked (bfloat16); empty: none")
    parser.add_argument("--skip-engine-checks", action="store_true",
                        help="leave out the family-independent checks (kestrel-tiny, CUDA graphs, async)")
    args = parser.parse_args()
    device = args.device
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    results: dict = {"gpu": gpu, "torch": torch.__version__, "checks": []}
    batch = checks.prompts()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            model_dir = f"{tmp}/{arch}"
            family, overrides = VARIANTS.get(arch, (arch, {}))
            write_tiny_checkpoint(model_dir, arch=family, seed=1, **overrides)
            for dtype in filter(None, args.dtypes.split(",")):
                record(results, {"arch": arch, **checks.parity_check(model_dir, arch, device, batch, dtype, 16)},
                       args.out)
            methods = [m for m in args.methods.split(",") if m]
            reference = (checks.hf_greedy(checks.hf_model(model_dir, torch.bfloat16, device), batch, 16)
                         if methods else [])
            for method in methods:
                quantized = checks.kestrel_greedy(model_dir, batch, device, 16, dtype="bfloat16", quantization=method)
                record(results, {"arch": arch, "dtype": "bfloat16", "quantization": method,
                                 **checks.agreement(quantized, reference)}, args.out)
    for row in [] if args.skip_engine_checks else checks.correctness_checks(device):
        record(results, row, args.out)
    return 0


def record(results: dict, row: dict, out: str) -> None:
    """Keep every finished check on disk, so a run stopped by a time limit still reports what it did."""
    results["checks"].append(row)
    print(json.dumps(row), flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "gpu-smoke.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
