"""Correctness checks that run inside the benchmark scripts before anything is timed.

1. Greedy outputs of kestrel and HF transformers on small real-architecture models (the bundled, trained
   kestrel-tiny Llama, and random Llama/Mistral/Qwen2 checkpoints when asked), token agreement over 16 prompts.
   Where they diverge, the float32 logit margin between the two candidates at the first divergence is
   recorded: a margin within bf16's rounding of the logits explains the divergence.
2. CUDA-graph vs eager decoding in kestrel: identical tokens (a padded bucket and an exact one), BF16 and FP8.
3. Async scheduling vs synchronous steps: identical greedy tokens.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kestrel.bench import common
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.sampling_params import SamplingParams
from kestrel.tiny import default_model_path

MAX_NEW = 32
# bf16 keeps 8 significant bits: logits of magnitude ~10 are rounded by up to ~0.03, and every layer adds more.
BF16_EXPLAINED_MARGIN = 0.25


def prompts(count: int = 16, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))] for _ in range(count)]


def hf_model(model_dir: str, dtype: torch.dtype, device: str) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model: Any, batch: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for p in batch:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def kestrel_greedy(model_dir: str, batch: list[list[int]], device: str, max_new: int = MAX_NEW,
                   **kwargs: Any) -> list[list[int]]:
    engine = common.build_engine(model_dir, device=device, max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, output_kind="final_only")
    for i, prompt in enumerate(batch):
        engine.core.add_request(str(i), prompt, params)
    result: dict[str, list[int]] = {}
    while engine.core.has_unfinished_requests():
        for out in engine.core.step():
            result[out.request_id] = list(out.outputs[0].token_ids)
    common.release(engine)
    return [result[str(i)] for i in range(len(batch))]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    first_divergence = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in zip(a, b)]
    tokens = sum(len(x) for x in a)
    matching = sum(sum(u == v for u, v in zip(x, y)) for x, y in zip(a, b))
    return {"identical_sequences": sum(x == y for x, y in zip(a, b)), "sequences": len(a),
            "token_agreement": matching / max(tokens, 1), "first_divergence": first_divergence}


def divergence_margins(model32: Any, batch: list[list[int]], ours: list[list[int]], theirs: list[list[int]],
                       first: list[int | None]) -> list[float]:
    """At each first divergence, |logit(ours) - logit(theirs)| of a float32 forward over the shared prefix."""
    device = next(model32.parameters()).device
    margins = []
    with torch.inference_mode():
        for prompt, a, b, k in zip(batch, ours, theirs, first):
            if k is None:
                continue
            ids = torch.tensor([prompt + a[:k]], device=device)
            logits = model32(ids).logits[0, -1].float()
            margins.append(abs(logits[a[k]] - logits[b[k]]).item())
    return margins


def parity_check(model_dir: str, name: str, device: str, batch: list[list[int]], dtype: str = "bfloat16",
                 max_new: int = MAX_NEW) -> dict[str, Any]:
    """kestrel vs HF transformers, greedy; divergences explained against a float32 forward."""
    started = time.perf_counter()
    hf = hf_model(model_dir, getattr(torch, dtype), device)
    theirs = hf_greedy(hf, batch, max_new)
    del hf
    ours = kestrel_greedy(model_dir, batch, device, max_new, dtype=dtype)
    row: dict[str, Any] = {"check": "kestrel vs HF transformers greedy", "model": name, "dtype": dtype,
                           "max_new_tokens": max_new, **agreement(ours, theirs)}
    if row["identical_sequences"] < len(batch):
        hf32 = hf_model(model_dir, torch.float32, device)
        margins = divergence_margins(hf32, batch, ours, theirs, row["first_divergence"])
        del hf32
        row["divergence_logit_margins_fp32"] = [round(m, 4) for m in margins]
        row["divergences_explained_by_bf16"] = all(m <= BF16_EXPLAINED_MARGIN for m in margins)
    row["pass"] = row["identical_sequences"] == len(batch) or row["divergences_explained_by_bf16"]
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def graph_check(model_dir: str, name: str, device: str, batch: list[list[int]],
                quantization: str | None) -> dict[str, Any]:
    """CUDA-graph decode vs eager decode: identical tokens, for a padded bucket (13 of 16) and an exact one."""
    kwargs = {"dtype": "bfloat16", "max_num_seqs": 16, "quantization": quantization}
    rows = {}
    for n in (13, 16):
        eager = kestrel_greedy(model_dir, batch[:n], device, enforce_eager=True, **kwargs)
        graphs = kestrel_greedy(model_dir, batch[:n], device, enforce_eager=False, **kwargs)
        rows[n] = agreement(graphs, eager)
    identical = all(r["identical_sequences"] == r["sequences"] for r in rows.values())
    return {"check": "CUDA graphs vs eager", "model": name, "dtype": "bfloat16", "quantization": quantization,
            "batches": {str(n): r for n, r in rows.items()}, "pass": identical}


def async_check(model_dir: str, name: str, device: str, batch: list[list[int]]) -> dict[str, Any]:
    """Async scheduling (step N+1 launched before step N's tokens reach the host) vs synchronous steps:
    identical greedy tokens, BF16, CUDA graphs on."""
    kwargs = {"dtype": "bfloat16", "max_num_seqs": 16}
    sync = kestrel_greedy(model_dir, batch, device, async_scheduling=False, **kwargs)
    overlapped = kestrel_greedy(model_dir, batch, device, async_scheduling=True, **kwargs)
    row = agreement(overlapped, sync)
    return {"check": "async scheduling vs synchronous", "model": name, "dtype": "bfloat16", **row,
            "pass": row["identical_sequences"] == row["sequences"]}


def correctness_checks(device: str = "cuda", random_archs: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Run every check; a failing check is recorded (with `pass: False`), never raised."""
    tiny = str(default_model_path())
    batch = prompts(vocab=8000)
    results = [parity_check(tiny, "kestrel-tiny (trained Llama)", device, batch)]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in random_archs:
            model_dir = str(Path(tmp) / arch)
            write_tiny_checkpoint(model_dir, arch=arch, seed=1)
            results.append(parity_check(model_dir, f"random tiny {arch}", device, prompts()))
    if device == "cuda":
        for quantization in (None, "fp8"):
            results.append(graph_check(tiny, "kestrel-tiny (trained Llama)", device, batch, quantization))
        results.append(async_check(tiny, "kestrel-tiny (trained Llama)", device, batch))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results
