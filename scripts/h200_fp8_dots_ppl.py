"""Perplexity of the bundled kestrel-tiny on held-out standard-library files (`kestrel bench ppl`'s windows) on a GPU,
BF16 activations, with a BF16 KV cache and with an FP8 one whose prefill attention runs the step's own keys' dots in
fp16 and in FP8 (launch feature `prefill_fp8_dots`): what the FP8 dots cost in accuracy. Every window is one prompt
of up to 512 tokens, so all its keys go through the staged prefill launch (`prefill_new_kv` on in every
variant). Writes OUT/fp8-dots-ppl.json.

    PYTHONPATH=$PWD python3 scripts/h200_fp8_dots_ppl.py --out OUT --max-files 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.bench import ppl  # noqa: E402
from kestrel.kernels import attention, common  # noqa: E402
from kestrel.loader.tokenizer import load_tokenizer  # noqa: E402
from kestrel.tiny import corpus, default_model_path  # noqa: E402

VARIANTS = [("bf16-kv", "auto", False), ("fp8-kv-fp16-dots", "fp8", False), ("fp8-kv-fp8-dots", "fp8", True)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-files", type=int, default=60)
    parser.add_argument("--baseline-files", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    model = str(default_model_path())
    engine = argparse.Namespace(dtype="bfloat16", device=args.device, max_model_len=None, max_num_batched_tokens=4096,
                                max_num_seqs=64, max_files=args.max_files, stride=None,
                                baseline_files=args.baseline_files)
    tokenizer = load_tokenizer(model)
    documents = ppl._held_out_documents(engine, tokenizer)
    counts = ppl.unigram_counts(tokenizer, corpus.texts(corpus.select_evenly(corpus.train_files(),
                                                                            args.baseline_files)), use_tqdm=False)
    original = common.launch_feature
    attention.FP8_DOTS_MIN_TOKENS = 0  # every step: the windows' steps are shorter than the GPU's threshold
    result = {"model": model, "files": len(documents), "tokens": sum(d.num_scored for d in documents), "rows": []}
    for name, kv_cache_dtype, fp8_dots in VARIANTS:
        common.launch_feature = (lambda feature, device, on=fp8_dots: on if feature == "prefill_fp8_dots" else
                                 True if feature == "prefill_new_kv" else original(feature, device))
        started = time.perf_counter()
        scorer = ppl._scorer(engine, model, kv_cache_dtype=kv_cache_dtype)
        scored = ppl.evaluate(scorer, documents, None, counts, use_tqdm=False)
        row = {"variant": name, "perplexity": scored["model"]["perplexity"],
               "bits_per_byte": scored["model"]["bits_per_byte"], "seconds": round(time.perf_counter() - started, 1)}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del scorer
    base = result["rows"][0]["perplexity"]
    for row in result["rows"]:
        row["vs_bf16_kv"] = row["perplexity"] / base - 1
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fp8-dots-ppl.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
