"""Find and iterate (name, tensor) over a checkpoint's weight files: safetensors (single or sharded with
`model.safetensors.index.json`), else PyTorch `pytorch_model*.bin` files (single or sharded with
`pytorch_model.bin.index.json`), read with `weights_only=True` so that no pickled code runs."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from kestrel.config import CheckpointError
from kestrel.loader.checkpoint_check import reading

INDEX_FILE = "model.safetensors.index.json"
PT_INDEX_FILE = "pytorch_model.bin.index.json"
FORMATS = {"safetensors": ("*.safetensors", INDEX_FILE), "pt": ("pytorch_model*.bin", PT_INDEX_FILE)}


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The directory has no weight files of the format, or its index names files that are not there."""


def weight_format(model_dir: str | Path) -> str | None:
    """"safetensors" or "pt", whichever the directory holds (safetensors first), or None."""
    root = Path(model_dir)
    for name, (pattern, index) in FORMATS.items():
        if (root / index).is_file() or any(root.glob(pattern)):
            return name
    return None


def checkpoint_files(model_dir: str | Path, fmt: str = "safetensors") -> list[Path]:
    """The shard files of format `fmt` named by its index, or every matching file when there is no index."""
    root = Path(model_dir)
    pattern, index_name = FORMATS[fmt]
    index = root / index_name
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"invalid checkpoint index {index}: expected a JSON object with a weight_map "
                                  f"(tensor name -> file) ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"invalid checkpoint index {index}: its weight_map must map tensor names to "
                                  "file names")
        files = [root / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointNotFoundError(f"{index} names shard files that do not exist: {absent}")
        return files
    files = sorted(root.glob(pattern))
    if not files:
        present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        raise CheckpointNotFoundError(
            f"no {pattern} weights in {root} (found: {present or 'nothing'}); "
            "use load_format='dummy' for random weights"
        )
    return files


def iterate_files(files: Sequence[Path], fmt: str, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of `files` (as `checkpoint_files` lists them); `progress`: a bar over them on stderr."""
    if progress:
        from tqdm.auto import tqdm

        files = tqdm(files, desc="Loading weights", unit="file", leave=False)
    for path in files:
        if fmt == "pt":
            with reading(path, fmt):
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(state, dict):
                raise CheckpointError(f"invalid checkpoint file {path}: it holds a {type(state).__name__}, not a "
                                      "dict of tensors")
            yield from state.items()
            del state
            continue
        with reading(path, fmt), safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)
