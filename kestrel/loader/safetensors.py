"""Iterate (name, tensor) over a single or sharded safetensors checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


class CheckpointNotFoundError(FileNotFoundError):
    pass


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The shard files named by the index, or every *.safetensors file when there is no index."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointNotFoundError(f"{index} names shard files that do not exist: {absent}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        raise CheckpointNotFoundError(
            f"no *.safetensors weights in {root} (found: {present or 'nothing'}); "
            "use load_format='dummy' for random weights"
        )
    return files


def iterate_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)
