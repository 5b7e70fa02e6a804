"""A truncated or corrupt weight file is a CheckpointError (a ConfigError: one line from the CLI, no traceback)
naming the file and what is wrong, found from the files' headers and sizes before any tensor is read."""

from __future__ import annotations

import json
import shutil
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kestrel import LLM
from kestrel.config import CheckpointError, ConfigError, ModelConfig
from kestrel.entrypoints import cli
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint

LAST_SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharded")
    write_tiny_checkpoint(path, arch="llama", seed=0, num_shards=2)
    return path


@pytest.fixture
def model(sharded_dir, tmp_path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(sharded_dir, out)
    return out


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def write_safetensors(path: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def header_length_beyond_the_file(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(data) * 4) + data[8:])


def bad_json_header(path: Path) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"{" + b"\xff" * (length - 1) + data[8 + length:])


def offsets_beyond_the_file(path: Path) -> None:
    header, body = read_safetensors(path)
    name = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    entry = header[name]
    extra = 1024  # more rows of the last tensor than the data holds
    entry["shape"][0] += extra
    entry["data_offsets"][1] += extra * (entry["data_offsets"][1] - entry["data_offsets"][0]) // (
        entry["shape"][0] - extra)
    write_safetensors(path, header, body)


def shape_disagrees_with_offsets(path: Path) -> None:
    header, body = read_safetensors(path)
    name = next(n for n in header if n != "__metadata__")
    header[name]["shape"][0] += 1
    write_safetensors(path, header, body)


def trailing_bytes(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0" * 100)


def three_bytes(path: Path) -> None:
    path.write_bytes(b"abc")


@pytest.mark.parametrize(("corrupt", "problem"), [
    (truncate, r"truncated: its tensors need \d+ bytes of data .* and the file holds \d+ after its header"),
    (header_length_beyond_the_file, r"its header length is \d+ bytes and the file holds \d+ after the length"),
    (bad_json_header, "its header is not valid JSON"),
    (offsets_beyond_the_file, r"truncated: its tensors need \d+ bytes of data"),
    (shape_disagrees_with_offsets, r"tensor '[\w.]+' of shape \[\d+, \d+\] in F32 is \d+ bytes, and the header "
                                   r"gives it \d+"),
    (trailing_bytes, "100 bytes after its last tensor"),
    (three_bytes, "it is 3 bytes, shorter than the 8-byte header length"),
])
@pytest.mark.serial  # a time bound: run alone, after the rest (`make test`)
def test_a_corrupt_safetensors_shard_is_named_before_any_tensor_is_read(model, monkeypatch, corrupt, problem):
    corrupt(model / LAST_SHARD)

    def no_reading(*_args, **_kwargs):
        raise AssertionError("a weight file was opened for reading before the checkpoint was checked")

    monkeypatch.setattr("kestrel.loader.safetensors.safe_open", no_reading)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"invalid checkpoint file {model / LAST_SHARD}: {problem}"):
        load_model(ModelConfig(model=str(model)))
    assert time.perf_counter() - start < 1.0


def test_llm_reports_a_truncated_safetensors_file_as_a_checkpoint_error(model):
    truncate(model / LAST_SHARD)
    with pytest.raises(ConfigError, match=rf"{LAST_SHARD}: truncated"):
        LLM(str(model), max_model_len=64)


def test_kestrel_serve_prints_a_truncated_file_as_one_line(model, capsys):
    # In process (tests/unit/test_config_sanity.py runs `kestrel serve` as a subprocess for a bad config.json).
    truncate(model / LAST_SHARD)
    assert cli.main(["serve", "--model", str(model), "--port", "18932"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"kestrel: error: invalid checkpoint file {model / LAST_SHARD}: truncated")


@pytest.fixture
def bin_model(sharded_dir, tmp_path) -> Path:
    out = tmp_path / "bin"
    shutil.copytree(sharded_dir, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = {**load_file(str(sharded_dir / "model-00001-of-00002.safetensors")),
             **load_file(str(sharded_dir / LAST_SHARD))}
    torch.save(state, out / "pytorch_model.bin")
    return out


def test_a_truncated_pytorch_bin_is_a_checkpoint_error(bin_model):
    truncate(bin_model / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: not a readable zip archive .*truncated"):
        load_model(ModelConfig(model=str(bin_model)))


def test_a_pytorch_bin_that_torch_cannot_unpickle_is_a_checkpoint_error(bin_model):
    path = bin_model / "pytorch_model.bin"
    original = zipfile.ZipFile(path)
    members = {info.filename: original.read(info.filename) for info in original.infolist()}
    original.close()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as rewritten:
        for name, data in members.items():
            if name.endswith("data.pkl"):
                data = b"\x80\x02" + b"\xff" * (len(data) - 2)  # a pickle header, then no valid opcode
            rewritten.writestr(name, data)
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: torch.load\(weights_only=True\) cannot unpickle "
                                              r"it \(Unsupported operand 255\)"):
        load_model(ModelConfig(model=str(bin_model)))


def test_an_index_that_is_not_json_is_a_checkpoint_error(model):
    (model / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid checkpoint index .*model.safetensors.index.json"):
        load_model(ModelConfig(model=str(model)))


def test_a_directory_without_weights_is_a_checkpoint_error_too(model):
    for path in model.glob("*.safetensors*"):
        path.unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights"):
        load_model(ModelConfig(model=str(model)))
