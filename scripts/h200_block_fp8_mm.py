"""The dense layers of a block-FP8 checkpoint on the GPU, both ways, at Llama-3-8B's linear shapes ([128, 128] blocks):
- weight-only (the default): `ops.wna16_gemm` over the packed FP8 weight and model-dtype rows;
- W8A8 (`fp8_block_activations="fp8"`): `ops.quant_fp8_per_group` then `ops.block_fp8_mm`;
and W8A8 per channel (`ops.quant_fp8_per_token` + `ops.scaled_mm`) as the anchor of what an FP8 GEMM reaches.
Each path is checked against the float64 product of the same dequantized weight first; timed as CUDA-graph replays
(weights rotated past L2), microseconds per call, into OUT/block-fp8-mm.json.

    PYTHONPATH=. python3 scripts/h200_block_fp8_mm.py --out OUT [--ms 1,16,64,256,1024,4096,8192] [--smoke]
    PYTHONPATH=. python3 scripts/h200_block_fp8_mm.py --out OUT --plot before=A.json after=B.json   # the PNG only

Each run also plots its JSON into OUT/block-fp8-mm.png (microseconds per call against M, one panel per layer);
`--plot` draws the weight-only line of every labelled result and the W8A8 lines of the last.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kestrel import ops

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BLOCK = 128
FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def block_weight(N: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight and its per-row block scales ([N, K / 128], each block's scale over its 128 rows)."""
    w = torch.randn(N, K, generator=gen, device=DEVICE) * 0.02
    blocks = w.reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(FP8).reshape(N, K)
    return q, scale.repeat_interleave(BLOCK, dim=0)


def per_block(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    q, scale_x = ops.quant_fp8_per_group(x, BLOCK)
    return ops.block_fp8_mm(q, weight, scale_x, scales, BLOCK, torch.bfloat16)


def per_channel(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q, scale_x, _ = ops.quant_fp8_per_token(x)
    return ops.scaled_mm(q, weight, scale_x, scale, torch.bfloat16)


def per_row(weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block weight requantized per output row (the per-channel anchor's layout)."""
    w = weight.float() * scales.repeat_interleave(BLOCK, dim=1)
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    return (w / scale).clamp(-448, 448).to(FP8), scale


def timed(fn, copies: int, runs: int = 30) -> float:
    """Median microseconds per call of `fn(i)` over `copies` rotated inputs, replayed in one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(copies):
            fn(i)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return statistics.median(times)


def plot(results: dict[str, dict], path: Path) -> bool:
    """Microseconds against M per layer: each result's weight-only path, the last result's W8A8 paths."""
    from kestrel.bench.common import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return False
    last = list(results.values())[-1]
    layers = list(dict.fromkeys(r["layer"] for r in last["rows"]))
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 3.8), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        lines = [(f"weight-only ({label})", result) for label, result in results.items()]
        for label, result in lines:
            rows = [r for r in result["rows"] if r["layer"] == layer and r["weight_only_us"] is not None]
            ax.plot([r["M"] for r in rows], [r["weight_only_us"] for r in rows], marker="o", label=label)
        for kind in ("w8a8_block", "w8a8_channel"):
            rows = [r for r in last["rows"] if r["layer"] == layer and r[f"{kind}_us"] is not None]
            ax.plot([r["M"] for r in rows], [r[f"{kind}_us"] for r in rows], marker="x", linestyle="--",
                    label=kind.replace("_", " "))
        N, K = next((r["N"], r["K"]) for r in last["rows"] if r["layer"] == layer)
        ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="us per call", title=f"{layer} {N} x {K}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"block-FP8 dense layers ([{last['block']}, {last['block']}] blocks), {last['device']}")
    return save_figure(plt, fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ms", default="1,16,64,256,1024,4096,8192")
    p.add_argument("--smoke", action="store_true", help="small shapes, checks only (runs on the CPU)")
    p.add_argument("--plot", nargs="+", metavar="LABEL=JSON", help="plot these results only (no run)")
    args = p.parse_args()
    out = Path(args.out)
    if args.plot:
        results = {}
        for item in args.plot:
            label, sep, file = item.partition("=")
            if not sep:
                p.error(f"--plot takes LABEL=JSON items, got {item!r}")
            results[label] = json.loads(Path(file).read_text())
        plot(results, out / "block-fp8-mm.png")
        return 0
    if args.smoke:  # the script's own check on any device: small shapes, no timing
        SHAPES.clear()
        SHAPES.update({"small": (256, 384)})
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for name, (N, K) in SHAPES.items():
        copies = max(2, int(4e8 // (N * K)))  # weights past the L2 cache
        weights = [block_weight(N, K, gen) for _ in range(copies)]
        packed = [ops.pack_wna16(w, s[:, ::1], weight_type="fp8_e4m3", scale_dtype=torch.float32) for w, s in weights]
        channel = [per_row(w, s) for w, s in weights]
        for M in (int(m) for m in args.ms.split(",")):
            x = [torch.randn(M, K, generator=gen, device=DEVICE).to(torch.bfloat16) for _ in range(copies)]
            w0, s0 = weights[0]
            ref = x[0].double() @ (w0.double() * s0.double().repeat_interleave(BLOCK, dim=1)).T
            outs = {
                "weight_only": lambda i, x=x, packed=packed: ops.wna16_gemm(
                    x[i], packed[i].qweight, packed[i].scales, None, None, "fp8_e4m3", torch.bfloat16),
                "w8a8_block": lambda i, x=x, weights=weights: per_block(x[i], *weights[i]),
                "w8a8_channel": lambda i, x=x, channel=channel: per_channel(x[i], *channel[i]),
            }
            row = {"layer": name, "N": N, "K": K, "M": M}
            for kind, fn in outs.items():
                got = fn(0).double()
                err = float((got - ref).norm() / ref.norm())
                row[f"{kind}_rel_err"] = err
                assert err < 0.05, (kind, row)
                row[f"{kind}_us"] = None if args.smoke else timed(fn, copies)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    result = {"device": device, "block": BLOCK, "rows": rows}
    (out / "block-fp8-mm.json").write_text(json.dumps(result, indent=1) + "\n")
    if not args.smoke:
        plot({"run": result}, out / "block-fp8-mm.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
