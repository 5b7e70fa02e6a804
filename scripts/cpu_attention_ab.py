"""Two builds of the CPU paged attention (`kernels/cpu/paged_attention.c`) in one engine, alternated: offline
`LLM.generate` of the issue-33 workload (kestrel-tiny, float32, 64 prompts of 100 random token ids, 64 greedy tokens,
prefix caching off) with each library in turn, timing every kernel call. Prints each round's wall time, output
tokens per second and the kernel's time (all calls, and the mean of the decode-only calls).

    .venv/bin/python scripts/cpu_attention_ab.py --before OLD.c --after kestrel/kernels/cpu/paged_attention.c

`--before` / `--after` are C sources (e.g. `git show REV:kestrel/kernels/cpu/paged_attention.c > /tmp/old.c`),
each built by `native.py` as the engine builds its own.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import shutil
import tempfile
import time
from pathlib import Path

from kestrel import LLM, SamplingParams
from kestrel.kernels.cpu import attention, native

REPO = Path(__file__).resolve().parent.parent


def build(source: Path, out_dir: Path) -> ctypes._CFuncPtr:
    """`kestrel_paged_attention` of `source`, built by `native` (its flags, its cache) beside a copy of the headers
    the kernels include."""
    beside = out_dir / f"{len(list(out_dir.iterdir()))}"
    beside.mkdir()
    for header in native.SOURCE.parent.glob("*.h"):
        shutil.copy(header, beside)
    copy = beside / native.SOURCE.name
    shutil.copy(source, copy)
    fn = native._function(copy, "kestrel_paged_attention", native._PAGED_ATTENTION_ARGS)
    if fn is None:
        raise SystemExit(f"{source} did not build (no C compiler, or a compile error)")
    return fn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {"before": build(args.before, Path(tmp)), "after": build(args.after, Path(tmp))}
        chosen: dict = {"fn": libraries["after"]}
        native.paged_attention_fn = lambda: chosen["fn"]
        clock = {"all": 0.0, "calls": 0, "decode": 0.0, "decode_calls": 0}
        untimed = attention._native

        def timed(q, k_cache, v_cache, query_start_loc, seq_lens, *rest):
            start = time.perf_counter()
            served = untimed(q, k_cache, v_cache, query_start_loc, seq_lens, *rest)
            spent = time.perf_counter() - start
            clock["all"] += spent
            clock["calls"] += 1
            if q.shape[0] == seq_lens.shape[0]:
                clock["decode"] += spent
                clock["decode_calls"] += 1
            return served

        attention._native = timed
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(100)]} for _ in range(64)]
        llm = LLM(str(REPO / "kestrel/models/kestrel-tiny"), dtype="float32", device="cpu",
                  enable_prefix_caching=False, max_model_len=170)
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:4], params, use_tqdm=False)
        tokens: dict[str, list] = {}
        for _ in range(args.rounds):
            for name, fn in libraries.items():
                chosen["fn"] = fn
                clock.update(all=0.0, calls=0, decode=0.0, decode_calls=0)
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - start
                tokens[name] = [list(o.outputs[0].token_ids) for o in outputs]
                decode_ms = clock["decode"] / max(1, clock["decode_calls"]) * 1e3
                print(f"{name}: {wall:.2f} s, {64 * 64 / wall:.0f} out tok/s; kernel {clock['all']:.3f} s in "
                      f"{clock['calls']} calls, decode calls {decode_ms:.3f} ms each", flush=True)
        print("identical outputs" if tokens["before"] == tokens["after"] else "outputs differ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
