"""GPU check of the whole engine: greedy kestrel (Triton attention, W8A8 GEMMs) against HF transformers.

    python scripts/gpu_smoke.py --out DIR

Writes DIR/gpu-smoke.json: per architecture, greedy token agreement with transformers over 16 mixed-length
prompts (float32 and bfloat16), the same through FP8 and INT8 W8A8.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.loader.model_init import write_tiny_checkpoint  # noqa: E402

MAX_NEW = 16


def prompts(count: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 60))] for _ in range(count)]


def hf_greedy(model_dir: str, batch: list[list[int]], dtype: torch.dtype, device: str) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in batch:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def kestrel_greedy(model_dir: str, batch: list[list[int]], device: str, **kwargs) -> list[list[int]]:
    llm = LLM(model_dir, device=device, max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    first_divergence = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        first_divergence.append(k)
    tokens = sum(len(x) for x in a)
    matching = sum(sum(u == v for u, v in zip(x, y)) for x, y in zip(a, b))
    return {"identical_sequences": same, "sequences": len(a), "token_agreement": matching / max(tokens, 1),
            "first_divergence": first_divergence}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--archs", default="llama,mistral,qwen2")
    args = parser.parse_args()
    device = args.device
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    results: dict = {"gpu": gpu, "torch": torch.__version__, "checks": []}
    batch = prompts()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            model_dir = f"{tmp}/{arch}"
            write_tiny_checkpoint(model_dir, arch=arch, seed=1)
            for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                started = time.perf_counter()
                reference = hf_greedy(model_dir, batch, dtype, device)
                ours = kestrel_greedy(model_dir, batch, device, dtype=dtype_name)
                row = {"arch": arch, "dtype": dtype_name, **agreement(ours, reference),
                       "seconds": time.perf_counter() - started}
                record(results, row, args.out)
            for method in ("fp8", "int8"):
                quantized = kestrel_greedy(model_dir, batch, device, dtype="bfloat16", quantization=method)
                reference = hf_greedy(model_dir, batch, torch.bfloat16, device)
                row = {"arch": arch, "dtype": "bfloat16", "quantization": method, **agreement(quantized, reference)}
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
