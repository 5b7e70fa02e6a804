"""config.json is checked before anything is sized from it: absurd shape values are refused at once with the field
and its accepted range, and a model that cannot fit its device is refused by the memory plan (built on the meta
device, before any allocation) with the fields that drive its size and the bytes needed and available. The plan
itself is checked against what loading really allocates."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kestrel import LLM
from kestrel.config import HF_CONFIG_BOUNDS, ConfigError, ModelConfig, QuantConfig
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sanity-tiny")
    write_tiny_checkpoint(path, arch="llama", seed=0)
    return path


def with_config(tiny_dir: Path, out: Path, weights: bool = True, **changes) -> Path:
    """A copy of the tiny checkpoint whose config.json has `changes` (a None value removes the key)."""
    shutil.copytree(tiny_dir, out, ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None}
    (out / "config.json").write_text(json.dumps(config))
    return out


# ----- absurd values -------------------------------------------------------------------------------------------

@pytest.mark.serial  # a time bound: run alone, after the rest (`make test`)
def test_a_million_layers_is_refused_at_once_naming_the_field_and_its_range(tiny_dir, tmp_path):
    model = with_config(tiny_dir, tmp_path / "m", num_hidden_layers=1_000_000)
    refusal = r"num_hidden_layers=1000000: expected an integer in \[1, 1024\]"
    with pytest.raises(ConfigError, match=refusal):
        ModelConfig(model=str(model))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=refusal):
        LLM(str(model))
    assert time.perf_counter() - start < 1.0  # without the bound, still allocating layers after 120 s


def test_a_billion_entry_vocabulary_is_a_config_error_not_a_terabyte_allocation(tiny_dir, tmp_path):
    model = with_config(tiny_dir, tmp_path / "m", vocab_size=1_000_000_000)
    with pytest.raises(ConfigError, match=r"vocab_size=1000000000: expected an integer in \[1, 16777216\]"):
        LLM(str(model), max_model_len=64)


@pytest.mark.parametrize(("field", "value"), [
    ("hidden_size", 1 << 20), ("intermediate_size", 1 << 24), ("num_attention_heads", 100_000),
    ("num_key_value_heads", 0), ("head_dim", -64), ("max_position_embeddings", 10**12), ("vocab_size", 0),
    ("num_hidden_layers", "2"), ("hidden_size", 64.0), ("num_attention_heads", True), ("hidden_size", None),
])
def test_each_bounded_field_refuses_values_outside_its_range_or_not_integers(tiny_dir, tmp_path, field, value):
    config = json.loads((tiny_dir / "config.json").read_text())
    out = tmp_path / "m"
    shutil.copytree(tiny_dir, out)
    (out / "config.json").write_text(json.dumps({**config, field: value}))
    least, most = HF_CONFIG_BOUNDS[field]
    with pytest.raises(ConfigError, match=rf"{field}={value!r}: expected an integer in \[{least}, {most}\]"):
        ModelConfig(model=str(out))


def test_hf_overrides_are_checked_like_the_file(tiny_dir):
    with pytest.raises(ConfigError, match=r"with hf_overrides: num_hidden_layers=5000"):
        ModelConfig(model=str(tiny_dir), hf_overrides={"num_hidden_layers": 5000})


def test_heads_that_do_not_divide_are_refused(tiny_dir, tmp_path):
    grouped = with_config(tiny_dir, tmp_path / "kv", num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        ModelConfig(model=str(grouped))
    uneven = with_config(tiny_dir, tmp_path / "hd", hidden_size=66, num_attention_heads=4)
    with pytest.raises(ConfigError, match="hidden_size=66 is not divisible by num_attention_heads=4"):
        ModelConfig(model=str(uneven))
    # An explicit head_dim need not divide hidden_size (Gemma: 3072 hidden, 16 heads of 256).
    ModelConfig(model=str(with_config(tiny_dir, tmp_path / "ok", hidden_size=66, head_dim=16)))


def test_real_model_shapes_are_within_the_bounds(tiny_dir, tmp_path):
    from kestrel.bench.common import LLAMA3_70B

    largest = {**LLAMA3_70B, "vocab_size": 262_144, "hidden_size": 16_384, "intermediate_size": 53_248,
               "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
               "max_position_embeddings": 10_485_760, "head_dim": 256}
    ModelConfig(model=str(with_config(tiny_dir, tmp_path / "m", **largest)), max_model_len=64)


def test_kestrel_serve_prints_the_refusal_as_one_line_without_a_traceback(tiny_dir, tmp_path):
    model = with_config(tiny_dir, tmp_path / "m", num_hidden_layers=1_000_000)
    result = subprocess.run([sys.executable, "-m", "kestrel.entrypoints.cli", "serve", "--model", str(model),
                             "--port", "18931"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("kestrel: error:")]
    assert "num_hidden_layers=1000000: expected an integer in [1, 1024]" in line


# ----- the memory plan ---------------------------------------------------------------------------------------------

def test_a_model_too_large_for_the_host_is_refused_before_any_allocation(tiny_dir, tmp_path):
    # Within every bound, yet two 2^24 x 2^16 float32 tables alone are 8.8 TB.
    model = with_config(tiny_dir, tmp_path / "m", weights=False, vocab_size=1 << 24, hidden_size=1 << 16,
                        num_attention_heads=512, num_key_value_heads=8, intermediate_size=1 << 17)
    with pytest.raises(ConfigError) as raised:
        LLM(str(model), load_format="dummy", dtype="float32", max_model_len=64)
    message = str(raised.value)
    assert "the model does not fit on cpu" in message
    assert "vocab_size=16777216, hidden_size=65536" in message  # the fields that drive the largest part
    assert "embedding and LM head 8.80 TB" in message
    needed = int(message.split("it needs ")[1].split(" bytes")[0].replace(",", ""))
    assert needed > 2 * (1 << 24) * (1 << 16) * 4
    assert "bytes (" in message.split(" are available")[0].split(" and ")[-1]  # the bytes available


def _planned(monkeypatch) -> list:
    from kestrel import loader

    plans = []
    original = loader.check_memory_plan

    def recording(plan, *args, **kwargs):
        plans.append(plan)
        return original(plan, *args, **kwargs)

    monkeypatch.setattr(loader, "check_memory_plan", recording)
    return plans


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_plan_is_what_loading_allocates(tiny_dir, monkeypatch):
    plans = _planned(monkeypatch)
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=64)
    [plan] = plans
    model = llm.runner.model
    assert plan.weight_bytes == _bytes(model.parameters()) + _bytes(model.buffers())
    assert plan.kv_bytes == _bytes(llm.runner.kv_caches) > 0
    assert plan.needed_bytes == plan.weight_bytes + plan.kv_bytes


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_the_plan_counts_weights_quantized_at_load_in_8_bits(tiny_dir, monkeypatch, method):
    plans = _planned(monkeypatch)
    model = load_model(ModelConfig(model=str(tiny_dir), dtype="bfloat16"), QuantConfig(method=method))
    [plan] = plans
    assert plan.weight_bytes == _bytes(model.parameters()) + _bytes(model.buffers())
    # Loaded from a bf16 checkpoint, each such layer holds its 16-bit weight until it is quantized.
    assert plan.loading_bytes > plan.weight_bytes
    assert any(p.dtype in (torch.float8_e4m3fn, torch.int8) for p in model.parameters())


@pytest.mark.parametrize("flags, words", [
    (["--chat-template", "/nonexistent.jinja"], "no such file"),  # refused before the model loads
    (["--limit-mm-per-prompt", '{"image": 1}'], "this model takes text only"),  # the engine core process's path
])
def test_kestrel_serve_refusals_after_the_start_exit_and_leave_no_core_process(tiny_dir, flags, words):
    """Refused settings end `kestrel serve` (status 2, one line), whichever process the engine core runs in, and
    no process of its own outlives it holding its output: the fork server, started beside the model's load, is
    ended mid-preload (its imports take 10-20 s here; the pipes would stay open that long)."""
    server = subprocess.Popen([sys.executable, "-m", "kestrel.entrypoints.cli", "serve", str(tiny_dir), "--port",
                               "18932", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    output: dict[str, str] = {}
    reader = threading.Thread(target=lambda: output.update(zip(("out", "err"), server.communicate())), daemon=True)
    reader.start()  # drained as it runs, so no full pipe holds it up
    try:
        returncode = server.wait(timeout=120)
        reader.join(timeout=5)  # end of output once the command has exited
    finally:
        server.kill()
    assert not reader.is_alive(), "the output stayed open after `kestrel serve` exited: a process of its own holds it"
    stderr = output["err"]
    assert returncode == 2, stderr[-2000:]
    assert "Traceback" not in stderr and words in stderr


def test_the_gpu_benches_refuse_to_build_a_gpu_sized_model_on_the_cpu(capsys):
    from kestrel.entrypoints.cli import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    for suite in ("latency", "throughput"):
        assert main(["bench", suite]) == 2
        assert "no CUDA device" in capsys.readouterr().err
