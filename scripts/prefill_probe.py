"""Host and wall time of one eager prefill forward (128 tokens, batch 1, Llama-3-8B shape, random weights) and engine
TTFTs, of the checkout it runs in: `python3 scripts/prefill_probe.py fp8|bf16` prints one JSON line, then the
profiler's kernel table. The TTFT rows of scripts/h200_before_after.sh are host-bound; this separates the forward's
launch time from the engine's."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kestrel.bench import common
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.sampling_params import SamplingParams

PROMPT = 128


def main() -> int:
    precision = sys.argv[1]
    device = torch.device("cuda")
    model_dir, load_format = common.prepare_model(None, "llama3-8b", False, None, False, device)
    engine_args = {"load_format": load_format, "max_model_len": 2048, "max_num_seqs": 32}
    if precision == "fp8":
        engine_args.update(quantization="fp8", kv_cache_dtype="fp8")
    engine = common.build_engine(model_dir, **engine_args)
    model = engine.runner.model
    meta = AttentionMetadata(
        slot_mapping=torch.arange(PROMPT, device=device),
        query_start_loc=torch.tensor([0, PROMPT], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([PROMPT], dtype=torch.int32, device=device),
        block_tables=torch.arange(8, dtype=torch.int32, device=device).view(1, -1),
        max_query_len=PROMPT, max_seq_len=PROMPT)
    ids = torch.randint(0, 1000, (PROMPT,), device=device)
    positions = torch.arange(PROMPT, device=device)
    result: dict[str, object] = {}
    with torch.inference_mode():
        for _ in range(5):
            model(ids, positions, meta)
        torch.cuda.synchronize()
        host, wall = [], []
        for _ in range(20):
            start = time.perf_counter()
            model(ids, positions, meta)
            launched = time.perf_counter()
            torch.cuda.synchronize()
            host.append((launched - start) * 1e3)
            wall.append((time.perf_counter() - start) * 1e3)
        result["forward_host_ms"] = statistics.median(host)
        result["forward_total_ms"] = statistics.median(wall)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(ids, positions, meta)
            torch.cuda.synchronize()
        result["kernels"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ttfts = []
    for r in range(8):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.core.add_request(f"probe-{r}", list(range(10, 10 + PROMPT)), params)
        first = None
        while engine.core.has_unfinished_requests():
            outputs = engine.core.step()
            if first is None and any(out.outputs[0].token_ids for out in outputs):
                first = time.perf_counter() - start
        ttfts.append(first * 1e3)
    result["ttft_ms"] = ttfts
    print(json.dumps(result))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
