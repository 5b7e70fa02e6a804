"""A GGUF file's metadata and tensor table, read straight from its bytes.

The layout (GGUF version 2 and 3, little-endian): the magic `GGUF`, the version (u32), the tensor and metadata counts
(u64 each); each metadata entry a key string, a value type (u32) and the value; each tensor its name, its dimension
count (u32), its dimensions fastest first (u64 each), its GGML type (u32) and its offset (u64) from the start of the
data, which begins at the next multiple of `general.alignment` (32 by default) after the table. Strings are a u64
length and UTF-8 bytes; an array is its item type (u32), its length (u64) and the items.

`gguf.GGUFReader` builds a memory-mapped view per item, which for a 128k-token vocabulary (its tokens, merges and
token types: about 1.2 million items) took over ten seconds of start-up; here a string array is read in one pass
over the bytes and a numeric array is one `numpy.frombuffer`. Tensor data stay memory-mapped: a tensor's bytes are
read when used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types -> numpy dtypes of the fixed-size ones (7 is bool, 8 a string, 9 an array)
_NUMERIC = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# GGML types whose tensors are plain arrays of one numpy dtype; every other type is bytes of blocks
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `data` is a read-only view of the file, shaped as `gguf.GGUFReader` shapes it (dimensions
    slowest first; for a block type the last dimension counted in bytes)."""

    name: str
    shape: tuple[int, ...]  # dimensions slowest first
    type_id: int
    data: np.ndarray

    @property
    def tensor_type(self) -> Any:
        """The type as `gguf.GGMLQuantizationType`."""
        import gguf

        return gguf.GGMLQuantizationType(self.type_id)


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> str, number, bool or list of them) and tensors."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._bytes = np.memmap(path, dtype=np.uint8, mode="r")
        self._view = memoryview(self._bytes)
        if bytes(self._view[:4]) != MAGIC:
            raise ValueError("the file does not start with the GGUF magic bytes")
        version, tensor_count, field_count = struct.unpack_from("<IQQ", self._view, 4)
        if version not in VERSIONS:
            swapped = struct.unpack_from(">I", self._view, 4)[0]
            raise ValueError("a big-endian GGUF file (kestrel reads little-endian ones)" if swapped in VERSIONS
                             else f"GGUF version {version} (kestrel reads versions {VERSIONS})")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            (value_type,) = self._unpack("<I")
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.fields[key] = self._value(value_type)
        self._table = [self._tensor_entry() for _ in range(tensor_count)]
        names = [entry[0] for entry in self._table]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor names appear twice: {sorted({n for n in names if names.count(n) > 1})[:5]}")
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
        self._data_start = -(-self._pos // alignment) * alignment

    @cached_property
    def tensors(self) -> list[GGUFTensor]:
        import gguf

        tensors = []
        for name, dims, type_id, offset in self._table:
            shape = tuple(reversed(dims))
            start = self._data_start + offset
            if type_id in _PLAIN:
                dtype = np.dtype(_PLAIN[type_id])
                byte_shape, item_size = shape, dtype.itemsize
            else:
                dtype = np.dtype(np.uint8)
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
                if not shape or shape[-1] % block:
                    raise ValueError(f"tensor {name}: its rows of {shape[-1:]} do not hold whole blocks of {block}")
                byte_shape, item_size = (*shape[:-1], shape[-1] // block * block_bytes), 1
            size = item_size
            for dim in byte_shape:  # Python integers: no overflow on absurd dimensions
                size *= dim
            if start + size > len(self._bytes):
                raise ValueError(f"tensor {name}: its data run past the end of the file")
            data = self._bytes[start:start + size].view(dtype).reshape(byte_shape)
            tensors.append(GGUFTensor(name, shape, type_id, data))
        return tensors

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start = self._pos
        self._pos += length
        self._check_end()
        return str(self._view[start:self._pos], "utf-8")

    def _check_end(self) -> None:
        if self._pos > len(self._view):
            raise ValueError("the metadata run past the end of the file")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            return self._array(item_type, count)
        if value_type not in _NUMERIC:
            raise ValueError(f"unknown GGUF value type {value_type}")
        dtype = np.dtype(_NUMERIC[value_type])
        value = np.frombuffer(self._view, dtype=dtype.newbyteorder("<"), count=1, offset=self._pos)[0]
        self._pos += dtype.itemsize
        return value.item()

    def _array(self, item_type: int, count: int) -> list:
        if item_type in _NUMERIC:
            dtype = np.dtype(_NUMERIC[item_type])
            if self._pos + count * dtype.itemsize > len(self._view):
                raise ValueError("the metadata run past the end of the file")
            items = np.frombuffer(self._view, dtype=dtype.newbyteorder("<"), count=count, offset=self._pos)
            self._pos += count * dtype.itemsize
            return items.tolist()
        if item_type == _STRING:
            return self._strings(count)
        return [self._value(item_type) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        view, pos, items = self._view, self._pos, []
        length_of = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = length_of(view, pos)
            pos += 8
            items.append(str(view[pos:pos + length], "utf-8"))
            pos += length
        self._pos = pos
        self._check_end()
        return items

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (dim_count,) = self._unpack("<I")
        dims = self._unpack(f"<{dim_count}Q")
        type_id, offset = self._unpack("<IQ")
        return name, dims, type_id, offset
