"""Weight files checked before anything is loaded: a truncated or corrupt file is a `CheckpointError` naming the
file and what is wrong, found from its header and its size alone (milliseconds, whatever the checkpoint's size).

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte
range in the data), then the data: the header must fit the file, parse, and describe tensors whose byte ranges
tile the data exactly (what the safetensors reader demands, checked here so that the message names the file
and says what is missing). A PyTorch `.bin` must be a readable zip archive (torch's format since 1.6) whose
members lie within the file; what only unpickling can find is reported the same way by `reading`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from kestrel.config import CheckpointError

# The safetensors reader refuses larger headers.
MAX_HEADER_BYTES = 100_000_000
# Bits per element of each safetensors dtype; a dtype not listed here has its size left to the reader.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6,
}


def check_checkpoint_files(files: Sequence[Path], fmt: str) -> None:
    """Every weight file of `files` (format "safetensors" or "pt") is whole and well formed, else CheckpointError."""
    for path in files:
        if fmt == "pt":
            check_torch_zip(Path(path))
        else:
            check_safetensors(Path(path))


def _fail(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"invalid checkpoint file {path}: {problem}")


def check_safetensors(path: Path) -> dict[str, Any]:
    """The header of the safetensors file at `path` (tensor name -> its entry), once its bounds are checked."""
    size = os.path.getsize(path)
    if size < 8:
        raise _fail(path, f"it is {size} bytes, shorter than the 8-byte header length: truncated, or not a "
                          "safetensors file")
    with open(path, "rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        if header_bytes > size - 8:
            raise _fail(path, f"its header length is {header_bytes} bytes and the file holds {size - 8} after the "
                              "length: truncated, or not a safetensors file")
        if header_bytes > MAX_HEADER_BYTES:
            raise _fail(path, f"its header length {header_bytes} is beyond the {MAX_HEADER_BYTES}-byte limit of "
                              "safetensors: corrupt, or not a safetensors file")
        raw = f.read(header_bytes)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"its header is not valid JSON ({e}): corrupt, or not a safetensors file") from None
    if not isinstance(header, dict):
        raise _fail(path, f"its header is a JSON {type(header).__name__}, not an object of tensors")
    data_bytes = size - 8 - header_bytes
    spans = sorted((_tensor_span(path, name, entry), name) for name, entry in header.items()
                   if name != "__metadata__")
    needed = max((end for (_, end), _ in spans), default=0)
    if needed > data_bytes:
        last = max(spans, key=lambda item: item[0][1])[1]
        raise _fail(path, f"truncated: its tensors need {needed} bytes of data (to the end of {last!r}) and the "
                          f"file holds {data_bytes} after its header (the file is {size} bytes, whole it would be "
                          f"{8 + header_bytes + needed})")
    offset = 0
    for (begin, end), name in spans:
        if begin != offset:
            raise _fail(path, f"tensor {name!r} starts at byte {begin} of the data where the previous one ends at "
                              f"{offset} (overlapping or gapped tensors): corrupt header")
        offset = end
    if offset != data_bytes:
        raise _fail(path, f"{data_bytes - offset} bytes after its last tensor that no tensor covers: corrupt, or "
                          "two files joined")
    return header


def _tensor_span(path: Path, name: str, entry: Any) -> tuple[int, int]:
    """(begin, end) of a tensor's bytes in the data, checked against its dtype and shape."""
    malformed = _fail(path, f"the header's entry of tensor {name!r} is malformed ({str(entry)[:200]}): expected "
                            "{'dtype': ..., 'shape': [...], 'data_offsets': [begin, end]}")
    if not isinstance(entry, dict):
        raise malformed
    shape, offsets, dtype = entry.get("shape"), entry.get("data_offsets"), entry.get("dtype")
    if (not isinstance(shape, list) or not all(_natural(d) for d in shape) or not isinstance(offsets, list)
            or len(offsets) != 2 or not all(_natural(o) for o in offsets) or offsets[0] > offsets[1]
            or not isinstance(dtype, str)):
        raise malformed
    begin, end = offsets
    bits = DTYPE_BITS.get(dtype)
    if bits is not None:
        numel = 1
        for dim in shape:
            numel *= dim
        if numel * bits != (end - begin) * 8:
            raise _fail(path, f"tensor {name!r} of shape {shape} in {dtype} is {numel * bits // 8} bytes, and the "
                              f"header gives it {end - begin}: corrupt header")
    return begin, end


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_torch_zip(path: Path) -> None:
    """A `pytorch_model*.bin` is a zip archive whose members lie within the file."""
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise _fail(path, f"not a readable zip archive ({e}): truncated, corrupt, or saved in torch's legacy "
                          "format (load it and save it again with torch.save)") from None
    for member in members:
        if member.header_offset + member.compress_size > size:
            raise _fail(path, f"its member {member.filename!r} runs past the end of the file ({size} bytes): "
                              "truncated")
    if not any(member.filename.endswith("data.pkl") for member in members):
        raise _fail(path, "a zip archive without the data.pkl of a torch.save file")


@contextlib.contextmanager
def reading(path: Path, fmt: str) -> Iterator[None]:
    """Errors of the safetensors reader or torch's unpickler while reading `path`, as a CheckpointError naming it."""
    try:
        yield
    except Exception as e:
        # torch's zip reader fails with RuntimeError; running out of memory is one too, and is not the file's fault.
        if not isinstance(e, _READ_ERRORS[fmt]) or "memory" in str(e).lower():
            raise
        if fmt == "pt":
            raise _fail(path, f"torch.load(weights_only=True) cannot unpickle it ({_unpickler_detail(e)}): "
                              "corrupt, or it holds more than tensors (its pickled code is never run)") from None
        raise _fail(path, f"the safetensors reader cannot read it ({_first_line(e)})") from None


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _unpickler_detail(error: Exception) -> str:
    """What torch's weights-only unpickler objects to, without its advice to unpickle with code execution on."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        detail = text.split(marker, 1)[1].split("Check the documentation", 1)[0]
        return " ".join(detail.split()) or type(error).__name__
    return _first_line(error)


_READ_ERRORS: dict[str, tuple[type[Exception], ...]] = {
    "safetensors": (SafetensorError,),
    "pt": (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, RuntimeError),
}


__all__ = ["check_checkpoint_files", "check_safetensors", "check_torch_zip", "reading"]
