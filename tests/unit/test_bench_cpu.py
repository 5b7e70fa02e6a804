"""The CPU benches: `kestrel bench step-budget --device cpu` (op families, fast paths vs references) and
`kestrel bench cpu-throughput` (offline LLM.generate, interleaved), in their smoke modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kestrel.bench import cpu_step_budget, cpu_throughput, step_budget
from kestrel.config import ConfigError


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_step_budget_smoke(tmp_path: Path) -> None:
    out = tmp_path / "step-budget-cpu.json"
    assert step_budget.main(["--device", "cpu", "--smoke", "--threads", "1", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "step_budget_cpu" and result["config"]["threads"] == 1
    assert [(r["kind"], r["batch"]) for r in result["results"]] == [("decode", 1), ("decode", 3), ("prefill", 2)]
    for row in result["results"]:
        for variant in cpu_step_budget.VARIANTS:
            families = row[variant]["families_us"]
            assert set(families) == set(cpu_step_budget.FAMILIES)
            assert families["attention"] > 0 and families["gemm"] > 0 and families["norm"] > 0
            assert sum(families.values()) == pytest.approx(row[variant]["step_us"], rel=0.01, abs=1.0)
        assert row["fast"]["calls_per_step"]["attention"] == row["reference"]["calls_per_step"]["attention"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_instrumentation_is_removed_afterwards() -> None:
    import torch.nn.functional as F

    from kestrel import ops

    before = (ops.paged_attention, F.linear)
    assert step_budget.main(["--device", "cpu", "--smoke", "--threads", "1"]) == 0
    assert (ops.paged_attention, F.linear) == before


def test_cpu_refuses_gpu_only_flags() -> None:
    with pytest.raises(ConfigError, match="--precisions"):
        step_budget.run(_parse(["--device", "cpu", "--precisions", "fp8"]))
    with pytest.raises(ConfigError, match="--threads"):
        step_budget.run(_parse(["--threads", "2"]))


def test_sections_charge_nested_time_once() -> None:
    sections = cpu_step_budget.Sections()
    inner = sections.wrap("gemm", lambda: sum(range(20000)))
    outer = sections.wrap("sampler", lambda: [inner() for _ in range(3)])
    outer()
    assert sections.calls == {"gemm": 3, "sampler": 1}
    assert sections.seconds["gemm"] > 0 and sections.seconds["sampler"] >= 0


def test_cpu_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cpu-throughput.json"
    assert cpu_throughput.main(["--smoke", "--threads", "1", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"fast/1t", "reference/1t"} and result["identical_tokens"]
    assert all(row["output_tok_per_s"] > 0 for row in result["results"].values())
    assert out.with_suffix(".png").stat().st_size > 0


def _parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    step_budget.add_arguments(parser)
    return parser.parse_args(argv)
