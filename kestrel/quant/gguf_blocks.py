"""llama.cpp's quantized block formats, unpacked in torch on the load device: each GGML type's blocks become integer
values, one float32 scale per group and, for the types that store one, a float32 offset per group ("mins"), so that
the weight is `w = scale * value - min`. That is the form the weight-only kernel runs (`kernels/wna16.py`: int4 or
int8 values, float offsets in `zeros`), and dequantizing is the same formula.

| type | block | values | group | offsets |
|---|---|---|---|---|
| Q8_0 | 32 int8, fp16 d | q | 32 | - |
| Q4_0 | 32 nibbles, fp16 d | q - 8 | 32 | - |
| Q4_1 | 32 nibbles, fp16 d and m | q (0..15) | 32 | -m |
| Q5_0 | 32 nibbles + 32 high bits, fp16 d | q - 16 | 32 | - |
| Q5_1 | as Q5_0, fp16 d and m | q (0..31) | 32 | -m |
| Q2_K | 256 2-bit values, 4-bit scale and min per 16, fp16 d / dmin | q (0..3) | 16 | dmin * min |
| Q3_K | 256 3-bit values (2 bits + a high-bit mask), 6-bit signed scale per 16, fp16 d | q - 4 | 16 | - |
| Q4_K | 256 nibbles, 6-bit scale and min per 32, fp16 d / dmin | q (0..15) | 32 | dmin * min |
| Q5_K | as Q4_K plus a high bit per value | q (0..31) | 32 | dmin * min |
| Q6_K | 256 6-bit values (nibble + 2 high bits), int8 scale per 16, fp16 d | q - 32 | 16 | - |

The scale of a K-quant group is d times its small integer scale, exact in float32, as `gguf.quants` computes it; the
bit layouts are those `gguf.quants` reads (its dequantizer is the tests' oracle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class BlockForm:
    """How a type's weights run on the weight-only kernel: `bits` (4: int4, 8: int8) hold its values, one scale per
    `group` values, float offsets when `mins`; `unsigned4`: 4-bit values in [0, 15], shifted by 8 into int4's range
    (the shift moved into the offsets)."""

    bits: int
    group: int
    mins: bool
    unsigned4: bool = False


FORMS: dict[str, BlockForm] = {
    "Q8_0": BlockForm(8, 32, False), "Q4_0": BlockForm(4, 32, False), "Q4_1": BlockForm(4, 32, True, True),
    "Q5_0": BlockForm(8, 32, False), "Q5_1": BlockForm(8, 32, True), "Q2_K": BlockForm(4, 16, True),
    "Q3_K": BlockForm(4, 16, False), "Q4_K": BlockForm(4, 32, True, True), "Q5_K": BlockForm(8, 32, True),
    "Q6_K": BlockForm(8, 16, False),
}
# GGML type -> (values per block, bytes per block).
BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}


class Unpacked(NamedTuple):
    """`w = scales * values - mins` per group, in the `[rows, cols]` convention."""

    values: torch.Tensor  # int8 [rows, cols]
    scales: torch.Tensor  # float32 [rows, cols / group]
    mins: torch.Tensor | None  # float32 [rows, cols / group]


def merged_form(types: set[str] | list[str] | tuple[str, ...]) -> BlockForm:
    """The one kernel form that holds every type of a merged layer's parts: the wider values, the smaller group,
    offsets if any part has them."""
    forms = [FORMS[t] for t in types]
    return BlockForm(max(f.bits for f in forms), min(f.group for f in forms), any(f.mins for f in forms))


def unpack(blocks: torch.Tensor, type_name: str) -> Unpacked:
    """uint8 blocks `[rows, cols / block * bytes]` of `type_name` -> values, scales and offsets in its own form."""
    block, size = BLOCKS[type_name]
    rows = blocks.shape[0]
    b = blocks.reshape(-1, size)
    values, scales, mins = _UNPACKERS[type_name](b)
    return Unpacked(values.to(torch.int8).reshape(rows, -1), scales.reshape(rows, -1),
                    None if mins is None else mins.reshape(rows, -1))


def to_form(part: Unpacked, type_name: str, form: BlockForm) -> Unpacked:
    """One part's unpacked weight in a merged layer's `form` (its groups split to the layer's, zero offsets where
    the layer has them and the part does not, unsigned 4-bit values shifted into int4)."""
    own = FORMS[type_name]
    if form.bits < own.bits or form.group > own.group or own.group % form.group:
        raise ValueError(f"GGUF {type_name} ({own.bits}-bit values in groups of {own.group}) does not fit the form "
                         f"of {form.bits}-bit values in groups of {form.group}")
    values, scales, mins = part
    if form.bits == 4 and own.unsigned4:
        values = values - 8
        mins = (mins if mins is not None else 0.0) - 8.0 * scales
    split = own.group // form.group
    if split > 1:
        scales = scales.repeat_interleave(split, dim=1)
        mins = None if mins is None else mins.repeat_interleave(split, dim=1)
    if form.mins and mins is None:
        mins = torch.zeros_like(scales)
    return Unpacked(values, scales.contiguous(), None if mins is None else mins.contiguous())


def dequantize(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """The float32 weight `[rows, cols]` the blocks hold."""
    values, scales, mins = unpack(blocks, type_name)
    rows, cols = values.shape
    w = values.float().view(rows, scales.shape[1], -1) * scales[..., None]
    if mins is not None:
        w = w - mins[..., None]
    return w.reshape(rows, cols)


# ------------------------------------------------------------------------------------------ the formats


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each block, as float32 `[n, 1]`."""
    return b[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes `[n, L]` -> `[n, 2L]`: the low nibbles, then the high ones."""
    return torch.cat((qs & 15, qs >> 4), dim=1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """Bytes `[n, L]` -> their bits `[n, 8L]`, bit j of byte i at 8i + j (a little-endian word's bit order)."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
    return ((b[:, :, None] >> shifts) & 1).reshape(b.shape[0], -1)


def _spread(b: torch.Tensor, chunks: int, width: int, shifts: list[int], mask: int) -> torch.Tensor:
    """Bytes `[n, chunks * width]` read `len(shifts)` times at each shift: `[n, chunks, len(shifts), width]`
    flattened, the order of gguf's `reshape(n, chunks, 1, width) >> shifts` reads."""
    s = torch.tensor(shifts, device=b.device, dtype=torch.uint8).view(1, 1, -1, 1)
    return ((b.reshape(b.shape[0], chunks, 1, width) >> s) & mask).reshape(b.shape[0], -1)


def _q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8), _f16(b, 0), None


def _q4_0(b):
    return _nibbles(b[:, 2:18]).to(torch.int16) - 8, _f16(b, 0), None


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b, 0), -_f16(b, 2)


def _q5_low_high(b, high: int, low: int):
    return _nibbles(b[:, low:low + 16]) | (_bits(b[:, high:high + 4]) << 4)


def _q5_0(b):
    return _q5_low_high(b, 2, 6).to(torch.int16) - 16, _f16(b, 0), None


def _q5_1(b):
    return _q5_low_high(b, 4, 8), _f16(b, 0), -_f16(b, 2)


def _q2_k(b):
    scales = b[:, 0:16]
    values = _spread(b[:, 16:80], 2, 32, [0, 2, 4, 6], 3)
    return values, _f16(b, 80) * (scales & 15).float(), _f16(b, 82) * (scales >> 4).float()


def _q3_k(b):
    low = _spread(b[:, 96:104], 1, 8, [0, 4], 15)
    high = _spread(b[:, 104:108], 1, 4, [0, 2, 4, 6], 3)
    scales = (low | (high << 4)).to(torch.int16) - 32
    q = _spread(b[:, 32:96], 2, 32, [0, 2, 4, 6], 3).to(torch.int16)
    high_bit = _spread(b[:, 0:32], 1, 32, list(range(8)), 1).to(torch.int16)
    return q - ((high_bit ^ 1) << 2), _f16(b, 108) * scales.float(), None


def _k_scales(sc12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins: the first four of each in the low six
    bits of bytes 0-3 / 4-7, the last four from the nibbles of bytes 8-11 and the top two bits of bytes 0-3 / 4-7."""
    d, m, md = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]
    scales = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=1)
    mins = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=1)
    return scales.float(), mins.float()


def _q4_k(b):
    scales, mins = _k_scales(b[:, 4:16])
    return _spread(b[:, 16:144], 4, 32, [0, 4], 15), _f16(b, 0) * scales, _f16(b, 2) * mins


def _q5_k(b):
    scales, mins = _k_scales(b[:, 4:16])
    low = _spread(b[:, 48:176], 4, 32, [0, 4], 15)
    high = _spread(b[:, 16:48], 1, 32, list(range(8)), 1)
    return low | (high << 4), _f16(b, 0) * scales, _f16(b, 2) * mins


def _q6_k(b):
    low = _spread(b[:, 0:128], 2, 64, [0, 4], 15)
    high = _spread(b[:, 128:192], 2, 32, [0, 2, 4, 6], 3)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    return (low | (high << 4)).to(torch.int16) - 32, _f16(b, 208) * scales, None


_UNPACKERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
              "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
