"""GPU check of constrained decoding and the sampling fields on kestrel-tiny (CUDA graphs, async scheduling on):
JSON-schema, regex and choice outputs are in their language; allowed_token_ids and bad_words hold.

    python scripts/gpu_structured_check.py --out DIR     (writes DIR/gpu-structured-check.json)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.sampling_params import StructuredOutputsParams  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "language": {"enum": ["python", "c", "rust"]},
                                           "active": {"type": "boolean"}},
          "required": ["name", "language", "active"], "additionalProperties": False}


def valid_person(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "language", "active"}
            and isinstance(value["name"], str) and len(value["name"]) <= 10
            and value["language"] in ("python", "c", "rust") and isinstance(value["active"], bool))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    llm = LLM(max_model_len=512)
    checks: dict[str, object] = {"async_scheduling": llm.engine.async_scheduling,
                                 "cuda_graphs": llm.runner.graph_runner is not None}
    params = [SamplingParams(temperature=t, seed=s, max_tokens=96, structured_outputs=StructuredOutputsParams(
        json=PERSON, disable_any_whitespace=True)) for s in range(4) for t in (0.0, 0.8, 1.4)]
    outs = llm.generate(["A person, as JSON:\n"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    checks["json_valid"] = sum(valid_person(t) for t in texts)
    checks["json_total"] = len(texts)
    checks["json_samples"] = texts[:3]
    date = r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d"
    regex_outs = llm.generate(["Date: "] * 8, [SamplingParams(temperature=1.0, seed=s, max_tokens=16,
                                                              structured_outputs=StructuredOutputsParams(regex=date))
                                               for s in range(8)], use_tqdm=False)
    checks["regex_valid"] = sum(bool(re.fullmatch(date, o.outputs[0].text)) for o in regex_outs)
    allowed = llm.generate("x", SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True,
                                               allowed_token_ids=[11, 12]), use_tqdm=False)[0].outputs[0]
    checks["allowed_token_ids_hold"] = set(allowed.token_ids) <= {11, 12}
    greedy = llm.generate("def f(x):", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    word = greedy.text.split()[1] if len(greedy.text.split()) > 1 else "return"
    banned = llm.generate("def f(x):", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                      bad_words=[word]), use_tqdm=False)[0].outputs[0]
    checks["bad_word"] = word
    checks["bad_words_hold"] = word not in banned.text.split()
    checks["structured_fill_ms_per_step"] = 1e3 * llm.engine.structured.fill_seconds / max(
        llm.engine.structured.num_fills, 1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu-structured-check.json").write_text(json.dumps(checks, indent=2) + "\n")
    print(json.dumps(checks, indent=2))
    ok = (checks["json_valid"] == checks["json_total"] and checks["regex_valid"] == 8
          and checks["allowed_token_ids_hold"] and checks["bad_words_hold"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
