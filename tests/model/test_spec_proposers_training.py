"""The kestrel-tiny draft proposers' training (CPU smoke runs of a few steps) and the contract between the
training side and the engine: the head and the draft model they write load in the engine, the engine's EAGLE
proposals equal the training-side head's on the same context, speculation with them stays lossless, and
`kestrel bench spec-decode --smoke` runs every method."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kestrel import LLM, SamplingParams
from kestrel.tiny import default_model_path
from training.tiny.eagle import DraftTrainOptions, TinyEagleHead, eagle_drafts, load_target, train_draft

SMALL = dict(steps=3, device="cpu", batch_size=2, context=64, max_train_files=3, max_eval_files=2,
             eval_positions=4, eval_prefix=32, num_speculative_tokens=3)
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("proposers")
    logs = {kind: train_draft(DraftTrainOptions(target=default_model_path(), out=root / kind, kind=kind, **SMALL))
            for kind in ("eagle", "draft")}
    return root, logs


def test_trainers_write_loadable_directories_and_acceptance_logs(trained):
    root, logs = trained
    for kind, log in logs.items():
        assert log["steps"] == 3
        report = log["acceptance"]
        assert report["positions"] == 4 and len(report["per_position_acceptance"]) == 3
        assert report["mean_accepted_length"] == pytest.approx(1 + report["mean_accepted_tokens"])
        assert json.loads((root / kind / "train_log.json").read_text())["acceptance"] == report
    assert {p.name for p in (root / "eagle").iterdir()} == {"config.json", "model.safetensors", "train_log.json"}
    assert json.loads((root / "draft" / "config.json").read_text())["num_hidden_layers"] == 2


def test_engine_runs_the_trained_proposers(trained, record_proposals):
    """Lossless with both; the engine's EAGLE proposals equal the training-side head's on the same contexts."""
    root, _ = trained
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(dtype="float32", max_model_len=128).generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    for kind in ("draft", "eagle"):
        llm = LLM(dtype="float32", max_model_len=128, speculative_config={"model": str(root / kind),
                                                                          "num_speculative_tokens": 3})
        assert llm.config.speculative.method == ("eagle" if kind == "eagle" else "draft_model")
        recorded = record_proposals(llm.runner)
        assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == plain
        assert llm.stats.num_spec_draft_tokens > 0
    target = load_target(default_model_path(), torch.device("cpu"))
    head = TinyEagleHead(target.cfg, target)
    head.load_state_dict({k: v.float() for k, v in load_file(str(root / "eagle" / "model.safetensors")).items()})
    assert len(recorded) >= 3
    for tokens, drafts in recorded[:3]:
        assert eagle_drafts(head, target, torch.tensor([tokens]), 3)[0].tolist() == drafts


def test_bench_spec_decode_smoke(tmp_path):
    from kestrel.bench.spec_decode import main

    assert main(["--smoke", "--result-file", str(tmp_path / "spec.json")]) == 0
    result = json.loads((tmp_path / "spec.json").read_text())
    assert result["complete"]
    for method in ("ngram", "draft_model", "eagle"):
        assert result[method] and all(row["identical_to_baseline"] for row in result[method])
    assert result["draft_model"][0]["acceptance_rate"] == 1.0  # kestrel-tiny drafting for itself
    assert [row["k"] for row in result["verify_cost"]] == [1, 2]
