"""The 8k FP8 prefill's memory-bound launches on one GPU, at Llama-3-8B's shapes: `rope_store_kv` with the staged,
transposed V of the FP8 dots (this tree's against `--old-rope-kv FILE`, another version of `kernels/rope_kv.py`),
and the activation quantizer's launch (`quant_act._act_quant_kernel`) per producer under other launch shapes (warps,
one pass or chunked), each variant's output checked equal to the committed launch's.

Times are medians of CUDA-graph replays (`kestrel.bench.timing.time_calls`) over two copies of the inputs, with the
bytes each launch must move and the rate that makes. Writes OUT/prefill-small-kernels-<gpu>.json.

    PYTHONPATH=. python3 scripts/h200_prefill_small_kernels.py --out OUT [--old-rope-kv FILE]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/h200_prefill_small_kernels.py --out OUT --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
from pathlib import Path

import torch
import triton

from kestrel.bench.timing import time_calls
from kestrel.kernels import attention, common, quant_act, rope_kv
from kestrel.kernels.common import device_name, gpu_key

HEADS, KV_HEADS, HEAD, HIDDEN, INTER, BLOCK = 32, 8, 128, 4096, 14336, 16
SMOKE = dict(HEADS=4, KV_HEADS=2, HEAD=64, HIDDEN=256, INTER=384)
RUNS = 20


def rope_inputs(tokens: int, dims: dict, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    heads, kv_heads, head = dims["HEADS"], dims["KV_HEADS"], dims["HEAD"]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head, generator=g, device=device).to(torch.bfloat16)
    q, k, v = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=1)
    blocks = -(-tokens // BLOCK) + 4
    cache = torch.zeros(blocks, BLOCK, kv_heads, head, device=device).to(torch.float8_e4m3fn)
    order = torch.randperm(blocks, generator=g, device=device)
    slots = (order[torch.arange(tokens, device=device) // BLOCK] * BLOCK
             + torch.arange(tokens, device=device) % BLOCK)
    angles = torch.rand(tokens + 8, head // 2, generator=g, device=device) * 6.28
    return dict(positions=torch.arange(tokens, device=device), q=q, k=k, v=v, cos=angles.cos(), sin=angles.sin(),
                k_cache=cache, v_cache=cache.clone(), slots=slots)


def rope_call(module, x: dict, staged):
    return lambda: module.rope_store_kv(x["positions"], x["q"], x["k"], x["v"], x["cos"], x["sin"],
                                        x["k_cache"].shape[-1], x["k_cache"], x["v_cache"], x["slots"], 0.5, 0.25,
                                        staged=staged)


def measure_rope(tokens: int, dims: dict, device: torch.device, old, runs: int) -> dict:
    attention.FP8_DOTS_MIN_TOKENS = 0
    xs = [rope_inputs(tokens, dims, device, seed) for seed in (1, 2)]
    row = {"tokens": tokens}
    outs = {}
    for name, module in (("this tree", rope_kv), ("old", old)):
        if module is None:
            continue
        staged = [attention.new_staged_kv(tokens, x["k_cache"]) for x in xs]
        assert attention.stages_fp8(xs[0]["k_cache"], tokens)
        calls = [rope_call(module, x, s) for x, s in zip(xs, staged)]
        calls[0]()
        outs[name] = [t.view(torch.uint8).clone() for t in (*staged[0], xs[0]["v_cache"])]
        row[name], row[f"{name} graphed"] = time_calls(calls, runs, device)
    if "old" in outs:
        row["equal"] = all(torch.equal(a, b) for a, b in zip(outs["this tree"], outs["old"]))
    kv = dims["KV_HEADS"] * dims["HEAD"]
    row["bytes"] = tokens * (2 * (dims["HEADS"] * dims["HEAD"] + 2 * kv)  # q, k, v read
                             + 2 * dims["HEADS"] * dims["HEAD"] + 4 * kv)  # q out, K/V cache + staged
    print(json.dumps(row), flush=True)
    return row


def quant_inputs(rows: int, width: int, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, width, generator=g, device=device).to(torch.bfloat16)
    r = torch.randn(rows, width, generator=g, device=device).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(width, generator=g, device=device)).to(torch.bfloat16)
    return x, r, w


PRODUCERS = {  # name: (the quantizer's public call of inputs (x, residual, weight) -> its results, x is [M, 2 K])
    "rms_residual": (lambda x, r, w: quant_act.rms_norm_quant(x, w, 1e-5, torch.float8_e4m3fn, residual=r), False),
    "identity": (lambda x, r, w: (quant_act.quant_fp8_per_token(x),), False),
    "silu_mul": (lambda x, r, w: (quant_act.silu_mul_quant(x, torch.float8_e4m3fn),), True),
}


@contextlib.contextmanager
def launch_shape(warps: int, one_pass: bool, block: int):
    """`quant_act`'s launches under the launch shape given: its warps, and one pass or chunks of `block`."""
    saved = quant_act._launch_options, quant_act._MAX_ONE_PASS, quant_act._LOOP_BLOCK
    quant_act._launch_options = lambda x, _: {"num_warps": warps, **common.launch_options(x)}
    if not one_pass:
        quant_act._MAX_ONE_PASS, quant_act._LOOP_BLOCK = 0, block
    try:
        yield
    finally:
        quant_act._launch_options, quant_act._MAX_ONE_PASS, quant_act._LOOP_BLOCK = saved


def _bytes_of(results: tuple) -> list[torch.Tensor]:
    """The tensors of a quantizer's results (a QuantAct, and the new residual where there is one), FP8 as bytes."""
    tensors = [t for r in results for t in (r if isinstance(r, quant_act.QuantAct) else (r,)) if t is not None]
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in tensors]


def measure_quant(name: str, rows: int, width: int, device: torch.device, runs: int,
                  warps: tuple[int, ...] = (4, 8, 16, 32)) -> list[dict]:
    call, gated = PRODUCERS[name]
    xs = [quant_inputs(rows, width, device, seed) for seed in (3, 4)]
    K = width // 2 if gated else width
    committed_block = triton.next_power_of_2(K)
    committed_warps = quant_act._launch_options(xs[0][0], committed_block)["num_warps"]
    variants = [(w, True, committed_block) for w in warps]
    if len(warps) > 2:
        variants += [(w, False, b) for w in (4, 8) for b in (1024, 2048, 4096) if b < K]
    ref = _bytes_of(call(*xs[0]))
    moved = rows * (x_bytes := xs[0][0].shape[1] * 2) + rows * K + rows * 4
    if name == "rms_residual":
        moved += 2 * rows * x_bytes
    out = []
    for warps, one_pass, block in variants:
        try:
            with launch_shape(warps, one_pass, block):
                equal = all(torch.equal(a, b) for a, b in zip(_bytes_of(call(*xs[0])), ref))
                us, graphed = time_calls([lambda x=x: call(*x) for x in xs], runs, device)
        except Exception as err:  # a launch shape that does not compile (registers) is reported, not fatal
            out.append({"op": name, "warps": warps, "one_pass": one_pass, "block": block, "error": str(err)[:200]})
            continue
        row = {"op": name, "rows": rows, "K": K, "warps": warps, "one_pass": one_pass, "block": block,
               "committed": (warps, one_pass, block) == (committed_warps, K <= quant_act._MAX_ONE_PASS,
                                                         committed_block),
               "us": us, "graphed": graphed, "equal": equal, "bytes": moved, "tb_per_s": moved / us / 1e6}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--old-rope-kv", type=Path, help="another version of kernels/rope_kv.py to time against")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a check of this script)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    dims = SMOKE if args.smoke else dict(HEADS=HEADS, KV_HEADS=KV_HEADS, HEAD=HEAD, HIDDEN=HIDDEN, INTER=INTER)
    old = None
    if args.old_rope_kv:
        spec = importlib.util.spec_from_file_location("rope_kv_old", args.old_rope_kv)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    runs = 2 if args.smoke else RUNS
    if not args.smoke:
        common.launch_feature = lambda name, device: name == "prefill_fp8_dots" or _committed(name, device)
    result = {"gpu": device_name(0) if device.type == "cuda" else "cpu", "rope": [], "quant": []}
    for block_t in (64, 128):
        rope_kv.V_TRANSPOSED_TOKENS = block_t
        for tokens in ((40,) if args.smoke else (2048, 8192)):
            result["rope"].append({"v_block_tokens": block_t, **measure_rope(tokens, dims, device, old, runs)})
    rope_kv.V_TRANSPOSED_TOKENS = 64
    rows = 24 if args.smoke else 8192
    for name, width in (("rms_residual", dims["HIDDEN"]), ("identity", dims["HIDDEN"]),
                        ("silu_mul", 2 * dims["INTER"])):
        result["quant"] += measure_quant(name, rows, width, device, runs)
    for few in ((3,) if args.smoke else (1, 64, 512, 2048)):  # decode and short-prompt rows
        result["quant"] += measure_quant("silu_mul", few, 2 * dims["INTER"], device, runs, warps=(8, 16))
    key = gpu_key(result["gpu"]) if device.type == "cuda" else "cpu"
    (args.out / f"prefill-small-kernels-{key}.json").write_text(json.dumps(result, indent=1))


_committed = common.launch_feature

if __name__ == "__main__":
    main()
