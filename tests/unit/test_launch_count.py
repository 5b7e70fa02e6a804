"""The debug launch counter (`LLM(..., debug_launch_count=True)`) on CPU: a proxy count that sees fusion."""

from __future__ import annotations

from pathlib import Path

import pytest

from kestrel import LLM
from kestrel.config import ConfigError
from kestrel.loader.model_init import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("launches")
    write_tiny_checkpoint(path, arch="llama", seed=0)
    return path


def test_off_by_default_and_no_graphs_on_cpu(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=64, device="cpu")
    assert llm.runner.launches_per_layer is None
    assert llm.runner.graph_runner is None and llm.runner.capture_seconds == 0.0


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_fused_producers_launch_less(checkpoint: Path, quantization: str) -> None:
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=64, device="cpu", quantization=quantization,
              debug_launch_count=True)
    fused = llm.runner.launches_per_layer
    assert isinstance(fused, int) and fused > 0
    for layer in llm.runner.model.model.layers:
        layer.fuse_quant_producers = False
    unfused = llm.runner._count_layer_launches()
    # Each fused producer replaces a norm (or SiLU-mul) plus a quantization; three per layer.
    assert fused < unfused


def test_unquantized_layer_is_one_launch_per_op(checkpoint: Path) -> None:
    """RMSNorm, qkv, RoPE + KV write, attention, o_proj, RMSNorm + residual, gate_up, SiLU-mul, down: each one
    launch (the unfused PyTorch norms, rotary and SiLU-mul made this 46)."""
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=64, device="cpu", debug_launch_count=True)
    assert llm.runner.launches_per_layer == 9


def test_flag_is_validated(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="debug_launch_count"):
        LLM(str(checkpoint), debug_launch_count="yes")
