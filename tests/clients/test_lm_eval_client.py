"""lm-evaluation-harness against `kestrel serve`: its `local-completions` and `local-chat-completions` models on
two small local tasks (multiple-choice loglikelihoods, greedy generation up to a stop string), compared with its
`hf` model, transformers running the same checkpoint. Every score, every per-choice loglikelihood and every
generated text must match."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .support import Served

MULTIPLE_CHOICE = [
    ("The capital of France is", [" Paris", " London", " Rome"]),
    ("Two plus two equals", [" four", " five", " three"]),
    ("The sky on a clear day is", [" blue", " green", " red"]),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"]),
    ("A week has seven", [" days", " hours", " years"]),
    ("Cats are often kept as", [" pets", " tools", " engines"]),
    ("The opposite of hot is", [" cold", " warm", " loud"]),
    ("Bees make", [" honey", " milk", " silk"]),
]
GENERATION = [("def add(a, b):", "return a + b"), ("import", "os"), ("Hello, my name is", "Kestrel"),
              ("1, 2, 3,", "4"), ("The quick brown fox", "jumps")]
TASKS = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
"""
CHOICE_TASK = """output_type: multiple_choice
doc_to_choice: choices
metric_list:
  - metric: acc
"""
GENERATION_TASK = """output_type: generate_until
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path) -> None:
    (folder / "choice.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": 0}) + "\n"
                                                 for q, c in MULTIPLE_CHOICE))
    (folder / "generation.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                     for q, a in GENERATION))
    (folder / "kestrel_choice.yaml").write_text(TASKS.format(name="kestrel_choice", data=folder / "choice.jsonl")
                                                + CHOICE_TASK)
    (folder / "kestrel_generation.yaml").write_text(
        TASKS.format(name="kestrel_generation", data=folder / "generation.jsonl") + GENERATION_TASK)


@pytest.fixture(scope="module")
def evaluations(served: Served, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("lm-eval")
    write_tasks(folder)
    both = ["kestrel_choice", "kestrel_generation"]
    # The API models send token ids; add_bos_token=True gives them the BOS token the hf model's tokenizer adds.
    api = {"model": served.model, "tokenizer_backend": "huggingface", "tokenizer": served.model_dir,
           "num_concurrent": 1, "max_retries": 1}
    spec = {"include_path": str(folder), "runs": {
        "hf": {"model": "hf", "model_args": {"pretrained": served.model_dir, "dtype": "float32", "device": "cpu"},
               "tasks": both},
        "hf_chat": {"model": "hf", "model_args": {"pretrained": served.model_dir, "dtype": "float32",
                                                  "device": "cpu"},
                    "tasks": ["kestrel_generation"], "apply_chat_template": True},
        "completions": {"model": "local-completions", "tasks": both,
                        "model_args": {**api, "base_url": f"{served.v1}/completions", "add_bos_token": True}},
        "chat": {"model": "local-chat-completions", "tasks": ["kestrel_generation"], "apply_chat_template": True,
                 "model_args": {**api, "base_url": f"{served.v1}/chat/completions"}},
    }}
    (folder / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(folder / "hf-home"),
           "OPENAI_API_KEY": served.api_key, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("lm_eval_runs.py")), str(folder / "spec.json"),
                           str(folder / "out.json")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((folder / "out.json").read_text())


def test_local_completions_loglikelihoods_and_accuracy_equal_hf(evaluations: dict[str, Any]) -> None:
    hf, served = evaluations["hf"], evaluations["completions"]
    assert served["results"]["kestrel_choice"]["acc"] == hf["results"]["kestrel_choice"]["acc"]
    expected = hf["samples"]["kestrel_choice"]
    got = served["samples"]["kestrel_choice"]
    assert [s["doc_id"] for s in got] == [s["doc_id"] for s in expected] == list(range(len(MULTIPLE_CHOICE)))
    for mine, theirs in zip(got, expected):
        assert mine["acc"] == theirs["acc"]
        assert len(mine["resps"]) == len(theirs["resps"]) == 3
        for (ll, greedy), (ll_hf, greedy_hf) in zip(mine["resps"], theirs["resps"]):
            assert float(ll) == pytest.approx(float(ll_hf), abs=1e-4)
            assert greedy == greedy_hf


@pytest.mark.parametrize(("run", "oracle"), [("completions", "hf"), ("chat", "hf_chat")])
def test_generations_equal_hf(evaluations: dict[str, Any], run: str, oracle: str) -> None:
    got = evaluations[run]["samples"]["kestrel_generation"]
    expected = evaluations[oracle]["samples"]["kestrel_generation"]
    assert len(got) == len(expected) == len(GENERATION)
    assert [s["resps"] for s in got] == [s["resps"] for s in expected]
    assert all(s["resps"][0] for s in got)
    assert (evaluations[run]["results"]["kestrel_generation"]["exact_match"]
            == evaluations[oracle]["results"]["kestrel_generation"]["exact_match"])
