"""W4A16 on the CPU, JSON on stdout.

Offline greedy decode of a W4A16 checkpoint and its float original: 4 prompts x 32 new tokens, out tok/s over 3
runs after a warm-up. Run it once per tree to compare (PYTHONPATH picks the tree):

    kestrel quantize /tmp/qwen2-0.5b-shape /tmp/qwen2-0.5b-w4a16 --scheme w4a16 --algorithm rtn --group-size 128
    PYTHONPATH=. python scripts/cpu_w4a16_offline.py /tmp/qwen2-0.5b-w4a16 /tmp/qwen2-0.5b-shape

`--kernels`: the GEMM alone at Qwen2-0.5B's linear shapes (int4, group 128, bf16 x), microseconds per call (median
of 20 after a warm-up) for the float32 reference, the C path and a bfloat16 `F.linear` of the dequantized weight:

    PYTHONPATH=. python scripts/cpu_w4a16_offline.py --kernels
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from kestrel import LLM, SamplingParams


def rates(path: str) -> dict:
    llm = LLM(model=path, device="cpu")
    prompts = [f"Question {i}: what is the capital of country number {i}?" for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    return {"model": path, "out_tok_s_runs": runs, "out_tok_s_median": statistics.median(runs)}


def kernel_times() -> dict:
    from kestrel.kernels import wna16 as wq
    from kestrel.kernels.cpu import wna16 as cpu_wna16

    def median_us(fn, runs: int = 20) -> float:
        fn()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, (N, K) in {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}.items():
        scales = ((torch.rand(N, K // 128, generator=gen) + 0.5) / 100).to(torch.bfloat16)
        w = wq.pack_wna16(torch.randint(-8, 8, (N, K), generator=gen), scales, weight_type="int4")
        dense = wq.dequantize_wna16(*w).to(torch.bfloat16)
        for M in (1, 16, 17, 128):
            x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
            rows.append({"shape": name, "N": N, "K": K, "M": M,
                         "reference_us": median_us(lambda x=x, w=w: wq.wna16_gemm_ref(x, *w, torch.bfloat16), 3),
                         "c_path_us": median_us(lambda x=x, w=w: cpu_wna16.wna16_gemm_cpu(x, *w, torch.bfloat16)),
                         "bf16_linear_us": median_us(lambda x=x, d=dense: torch.nn.functional.linear(x, d))})
    return {"threads": torch.get_num_threads(), "rows": rows}


def main(argv: list[str]) -> int:
    if argv == ["--kernels"]:
        print(json.dumps(kernel_times(), indent=1))
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps({"w4a16": rates(argv[0]), "float": rates(argv[1])}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
