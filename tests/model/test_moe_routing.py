"""The router's settings in `MoEArch` (scoring, grouped top-k): refused by name where a router cannot use them, and
honoured by the model's MoE block, whose choices are the float64 oracle's for each setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_families import write_family

from kestrel.config import ConfigError, ModelConfig
from kestrel.loader import load_model
from kestrel.model.arch import MoEArch
from kestrel.model.layers.moe import MoEMLP

BASE = dict(num_experts=8, top_k=2, intermediate_size=16, renormalize=True, sparse_layers=(True,))


@pytest.mark.parametrize(("changes", "match"), [
    ({"scoring": "softplus"}, "scoring='softplus'"),
    ({"num_groups": 3}, "num_groups=3 must divide the 8 experts"),
    ({"num_groups": 4, "topk_groups": 0}, "topk_groups=0 must be in 1..num_groups=4"),
    ({"num_groups": 4, "topk_groups": 1, "top_k": 3}, "top_k=3 must be in 1..2"),
])
def test_a_router_it_cannot_run_is_a_config_error_naming_the_setting(changes, match) -> None:
    with pytest.raises(ConfigError, match=f"invalid config.json: the router's {match}"):
        MoEArch(**{**BASE, **changes})


def oracle_ids(logits: torch.Tensor, top_k: int, scoring: str, num_groups: int, topk_groups: int) -> list[list[int]]:
    """float64 scores; among the experts of the topk_groups groups with the best expert, the top_k, the lowest
    index first among equals."""
    logits = logits.double()
    scores = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    per_group = scores.shape[1] // num_groups
    out = []
    for row in scores.tolist():
        best = [max(row[g * per_group:(g + 1) * per_group]) for g in range(num_groups)]
        kept = sorted(range(num_groups), key=lambda g: (-best[g], g))[:topk_groups]
        allowed = [e for e in range(len(row)) if e // per_group in kept]
        out.append(sorted(allowed, key=lambda e: (-row[e], e))[:top_k])
    return out


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> torch.nn.Module:
    path: Path = write_family(tmp_path_factory.mktemp("qwen3-moe"), "qwen3-moe", seed=5)
    return load_model(ModelConfig(model=str(path), dtype="float32"), None, "cpu", None)


@pytest.mark.parametrize(("scoring", "num_groups", "topk_groups"), [
    ("softmax", 1, 1), ("sigmoid", 1, 1), ("softmax", 2, 1), ("sigmoid", 4, 2)])
def test_the_moe_block_routes_as_its_arch_says(qwen3_moe, scoring: str, num_groups: int, topk_groups: int) -> None:
    block = next(m for m in qwen3_moe.modules() if isinstance(m, MoEMLP))
    # The family's config routes ungrouped by softmax; the block takes the settings an arch of these would give it.
    moe = MoEArch(num_experts=block.in_proj.weight.shape[0], top_k=block.top_k, intermediate_size=16,
                  renormalize=block.renormalize, sparse_layers=(True,), scoring=scoring, num_groups=num_groups,
                  topk_groups=topk_groups)
    block.scoring, block.num_groups, block.topk_groups = moe.scoring, moe.num_groups, moe.topk_groups
    x = torch.randn(9, block.in_proj.weight.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weights, ids = block.route(x)
        logits = block.in_proj(x)
    assert ids.tolist() == oracle_ids(logits, block.top_k, scoring, num_groups, topk_groups)
    chosen = logits.double().softmax(-1) if scoring == "softmax" else logits.double().sigmoid()
    chosen = chosen.gather(1, ids)
    torch.testing.assert_close(weights.double(), chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)

