"""Runs lm-evaluation-harness evaluations in a process of their own (the tests start it with the Hugging Face
libraries offline and caching under a temporary directory, settings those libraries read when imported).

    python lm_eval_runs.py SPEC.json OUT.json

SPEC: {"include_path": task YAML folder, "runs": {name: {"model", "model_args", "tasks", "apply_chat_template"}}}.
OUT: {name: {"results": {task: {metric: value}}, "samples": {task: [{"doc_id", "resps", metric: value}]}}}, the
samples in document order, `resps` the filtered responses (loglikelihood and is-greedy pairs, or generated text).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Only the tasks under include_path run: indexing lm-eval's ~14,700 bundled task YAMLs as well (the default)
    # took ~9 s of CPU on the 2-core machine.
    tasks = TaskManager(include_path=spec["include_path"], include_defaults=False)
    out: dict[str, Any] = {}
    for name, run_spec in spec["runs"].items():
        evaluated = lm_eval.simple_evaluate(model=run_spec["model"], model_args=run_spec["model_args"],
                                            tasks=run_spec["tasks"], task_manager=tasks, log_samples=True,
                                            apply_chat_template=run_spec.get("apply_chat_template", False),
                                            batch_size=1, bootstrap_iters=0)
        results = {task: {key.split(",")[0]: value for key, value in metrics.items() if "," in key}
                   for task, metrics in evaluated["results"].items()}
        samples = {}
        for task, logged in evaluated["samples"].items():
            samples[task] = [{"doc_id": s["doc_id"], "resps": s["filtered_resps"],
                              **{metric: s[metric] for metric in s["metrics"]}}
                             for s in sorted(logged, key=lambda s: s["doc_id"])]
        out[name] = {"results": results, "samples": samples}
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as spec_file:
        result = run(json.load(spec_file))
    with open(sys.argv[2], "w") as out_file:
        json.dump(result, out_file, default=str)
