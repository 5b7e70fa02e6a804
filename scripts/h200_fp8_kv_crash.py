"""Find the prefill attention call that faults on a GPU when kestrel-tiny (heads of 64) is built with an FP8 KV
cache, and replay it under variants, each in its own process (an illegal address ends the CUDA context).

    record: build the engine with every `paged_attention` call synchronized and its arguments saved (the last one
            saved before a fault is the faulting one) to OUT/calls/NNN.pt
    replay: run the saved call N under one variant (--variant), print ok / the error

    PYTHONPATH=$PWD python3 scripts/h200_fp8_kv_crash.py record --out OUT
    PYTHONPATH=$PWD python3 scripts/h200_fp8_kv_crash.py replay --out OUT --call N --variant asis
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.kernels import attention  # noqa: E402

VARIANTS = {
    "asis": {},
    "w4s3": {"prefill_cfg": attention.AttnConfig(128, 64, 4, 3)},
    "64x64": {"prefill_cfg": attention.AttnConfig(64, 64, 4, 3)},
    "s2": {"prefill_cfg": attention.AttnConfig(128, 64, 8, 2)},
    "bn32": {"prefill_cfg": attention.AttnConfig(128, 32, 8, 3)},
    "no-pairs": {"_no_pairs": True},
    "bf16-cache": {"_bf16_cache": True},
    "shared-kv": {"_shared_kv": True},
    "shared-kv-w4s3": {"_shared_kv": True, "prefill_cfg": attention.AttnConfig(128, 64, 4, 3)},
}


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def record(out: Path) -> int:
    from kestrel.bench.ppl import KestrelScorer
    from kestrel.tiny import default_model_path

    calls = out / "calls"
    calls.mkdir(parents=True, exist_ok=True)
    original = attention.paged_attention
    count = [0]

    def saving(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, *args, **kwargs):
        n = count[0]
        count[0] += 1
        meta = {"q": list(q.shape), "q_dtype": str(q.dtype), "cache": list(k_cache.shape),
                "cache_dtype": str(k_cache.dtype), "k_strides": list(k_cache.stride()),
                "v_strides": list(v_cache.stride()), "v_offset": v_cache.storage_offset(),
                "num_seqs": int(seq_lens.shape[0]), "block_tables": list(block_tables.shape),
                "args": [repr(a) for a in args],
                "kwargs": {k: (list(v.shape) if isinstance(v, torch.Tensor) else repr(v)) for k, v in kwargs.items()}}
        print(f"call {n}: {json.dumps(meta)}", flush=True)
        torch.cuda.synchronize()
        if k_cache.numel() * k_cache.element_size() < 2**28:  # the memory profile's calls, not the sized cache's
            torch.save({"q": q.cpu(), "k_cache": k_cache.cpu(), "v_cache": v_cache.cpu(),
                        "qsl": query_start_loc.cpu(), "seq_lens": seq_lens.cpu(), "block_tables": block_tables.cpu(),
                        "scale": scale, "args": _to(args, "cpu"), "kwargs": _to(kwargs, "cpu")}, calls / f"{n:03d}.pt")
        result = original(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, *args, **kwargs)
        torch.cuda.synchronize()
        print(f"call {n}: ok", flush=True)
        return result

    attention.paged_attention = saving
    scorer = KestrelScorer(str(default_model_path()), dtype="bfloat16", device="cuda", max_num_batched_tokens=4096,
                           max_num_seqs=64, kv_cache_dtype="fp8", enforce_eager=True)
    print("engine built", scorer.vocab_size, flush=True)
    return 0


def replay(out: Path, call: int, variant: str) -> int:
    saved = torch.load(out / "calls" / f"{call:03d}.pt", weights_only=False)
    options = dict(VARIANTS[variant])
    dev = torch.device("cuda")
    k_cache, v_cache = saved["k_cache"].to(dev), saved["v_cache"].to(dev)
    if options.pop("_bf16_cache", False):
        k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    if options.pop("_shared_kv", False):  # one allocation, V after K, as the engine's cache holds them
        both = torch.stack((k_cache.view(torch.uint8), v_cache.view(torch.uint8))).view(k_cache.dtype)
        k_cache, v_cache = both[0], both[1]
    if options.pop("_no_pairs", False):
        attention._v_in_pairs = lambda v, h: False
    kwargs = _to(saved["kwargs"], dev)
    kwargs.update(options)
    try:
        result = attention.paged_attention(saved["q"].to(dev), k_cache, v_cache, saved["qsl"].to(dev),
                                           saved["seq_lens"].to(dev), saved["block_tables"].to(dev), saved["scale"],
                                           *_to(saved["args"], dev), **kwargs)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the report is the point
        print(f"replay {call} {variant}: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
        return 1
    print(f"replay {call} {variant}: ok finite={bool(torch.isfinite(result.float()).all())}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["record", "replay"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--call", type=int, default=0)
    parser.add_argument("--variant", default="asis", choices=sorted(VARIANTS))
    args = parser.parse_args()
    out = Path(args.out)
    return record(out) if args.mode == "record" else replay(out, args.call, args.variant)


if __name__ == "__main__":
    sys.exit(main())
