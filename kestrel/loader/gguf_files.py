"""Where a GGUF model's files are, and their readers: a .gguf file, a directory holding one model, or a model split
by llama.cpp's gguf-split into `<name>-00001-of-0000N.gguf` files (the first holds the metadata, each holds some of
the tensors)."""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from kestrel.config import GGUF_SUFFIX, CheckpointError, ConfigError, is_gguf_model
from kestrel.loader.gguf_reader import GGUFFile, GGUFTensor

_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF model's files in split order (one file unless split)."""

    files: tuple[Path, ...]

    @property
    def first(self) -> Path:
        """The file holding the metadata (config, tokenizer, chat template)."""
        return self.files[0]

    @cached_property
    def readers(self) -> tuple[GGUFFile, ...]:
        """A reader per file (memory-mapped: tensors are read when used)."""
        return tuple(open_reader(path) for path in self.files)

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value `key` of the first file (a str, number, bool, or list of them), or `default`."""
        return self.readers[0].fields.get(key, default)

    @property
    def tensors(self) -> list[GGUFTensor]:
        """Every tensor of every file (name, tensor_type, data)."""
        return [tensor for reader in self.readers for tensor in reader.tensors]


def find_gguf(model: str | Path) -> GGUFModel:
    """The GGUF model at `model` (a .gguf file, one of a split set, or a directory holding one model); a
    CheckpointError when a split file is missing, a ConfigError when a directory holds several models."""
    path = Path(model)
    if not is_gguf_model(str(path)):
        raise ConfigError(f"invalid model={str(model)!r}: not a .gguf file, nor a directory holding one")
    if path.is_file():
        return GGUFModel(_split_set(path))
    found = sorted(p for p in path.iterdir() if p.name.endswith(GGUF_SUFFIX))
    models = {_split_set(p) for p in found if _is_first(p)}
    if len(models) != 1:
        raise ConfigError(f"invalid model={str(model)!r}: the directory holds {len(models)} GGUF models "
                          f"({[p.name for p in found]}); pass the path of the one .gguf file to serve")
    return GGUFModel(models.pop())


def _is_first(path: Path) -> bool:
    match = _SPLIT.match(path.name)
    return match is None or int(match["no"]) == 1


def _split_set(path: Path) -> tuple[Path, ...]:
    match = _SPLIT.match(path.name)
    if match is None:
        return (path,)
    count = int(match["count"])
    files = tuple(path.with_name(f"{match['stem']}-{no:05d}-of-{count:05d}{GGUF_SUFFIX}") for no in range(1, count + 1))
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(f"invalid GGUF model {files[0]}: it is split into {count} files and {absent} "
                              "are missing")
    return files


def open_reader(path: Path) -> GGUFFile:
    """A reader of `path` (`gguf_reader.GGUFFile`); a file it cannot read is a CheckpointError naming it. Readers
    are kept per file and version (size, modification time): start-up reads a model's metadata for its config, its
    tokenizer and its weights."""
    stat = path.stat()
    return _reader(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _reader(path: str, size: int, mtime_ns: int) -> GGUFFile:
    try:
        reader = GGUFFile(path)
        reader.tensors  # noqa: B018 - a malformed tensor table fails here, at open, not when a tensor is used
        return reader
    except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError, struct.error) as e:
        # what a malformed file raises
        raise CheckpointError(f"invalid GGUF file {path}: {type(e).__name__}: {e}") from e
