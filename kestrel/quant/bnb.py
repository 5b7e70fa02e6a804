"""bitsandbytes linear layers, as transformers saves them, run as weight-only layers on `ops.wna16_gemm`.

- LLM.int8 (`load_in_8bit`): `weight` int8 `[N, K]`, `SCB` float32 `[N]` (each row's absmax), `weight_format` (0:
  row-major, the only layout bitsandbytes still writes). `W = weight * SCB / 127`: W8A16 with per-channel scales
  `SCB / 127`.
- 4-bit (`load_in_4bit`, NF4 or FP4): the weight `[N, K]` flattened row-major and cut into blocks of `blocksize`
  elements (64 by default); each element a 4-bit code into bitsandbytes' NF4 or FP4 code book, two per byte (element
  2i in the high nibble), `weight` `[N * K / 2, 1]` (bytes, possibly viewed as another `bnb_4bit_quant_storage`
  dtype); `weight.absmax` one float32 per block; `weight.quant_map` the 16-entry code book;
  `weight.quant_state.bitsandbytes__<nf4|fp4>` a uint8 tensor holding JSON (quant_type, blocksize, dtype, shape, and
  with double quantization nested_blocksize, nested_dtype, nested_offset). Double quantization stores the absmax as
  uint8 codes into `weight.nested_quant_map` (256 entries) with float32 `weight.nested_absmax` per block of 256:
  `absmax = nested_quant_map[q] * nested_absmax[b // 256] + nested_offset`, decoded at load in float32 as
  bitsandbytes decodes it. `W[n, k] = code_book[c] * absmax[(n * K + k) // blocksize]`.

When K is a multiple of the block size, a block is a group of `blocksize` input features of one row: the layer runs
on the kernel as weight type "nf4" / "fp4_bnb" with group scales `[N, K / blocksize]` = the absmax. Otherwise (blocks
that straddle rows, or a tensor-parallel slice of the input features that cuts blocks) the layer is dequantized at
load to the model dtype, and a log line says so; LLM.int8 layers whose K the kernel cannot step through (not a
multiple of 16) likewise.

The packed weight and `SCB` load through the layer's own loader (merged shards, a rank's slice). The small tensors of
a 4-bit module (absmax, code books, the JSON) have dotted names no parameter can have: placeholders declare them by
name (`checkpoint_shards`) and keep the whole stored tensors until a module's set is complete; then its absmax is
decoded and checked against the JSON, and only this rank's share is kept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError
from kestrel.kernels.wna16 import FP4_BNB_VALUES, NF4_VALUES
from kestrel.quant.base import QuantMethod
from kestrel.quant.wna16 import GROUP_MULTIPLE, compact_dtype

logger = logging.getLogger(__name__)

QUANT_TYPES = ("nf4", "fp4")
# bitsandbytes' quant_type -> the kernel's weight type and its code book.
_WEIGHT_TYPE = {"nf4": "nf4", "fp4": "fp4_bnb"}
_CODE_BOOK = {"nf4": NF4_VALUES, "fp4": FP4_BNB_VALUES}
_STATE_SUFFIXES = ("absmax", "quant_map")
_NESTED_SUFFIXES = ("nested_absmax", "nested_quant_map")
_ROW_FORMAT = 0  # bitsandbytes' weight_format code of row-major int8 weights


@dataclass(frozen=True)
class _Blocks:
    """One part's decoded absmax: the whole stored tensor's (`row_offset`: the part's first row in it), or, where
    the part runs on the kernel, already this rank's group scales `[n, K_rank / blocksize]` (`scales`)."""

    blocksize: int
    absmax: torch.Tensor | None = None
    row_offset: int = 0
    scales: torch.Tensor | None = None


def _split(layer: nn.Module) -> tuple[bool, bool]:
    """(this rank holds a slice of the output features, ... of the input features)."""
    tp = getattr(layer, "tp_size", 1)
    split = getattr(layer, "tp_split", None)
    return tp > 1 and split == "output", tp > 1 and split == "input"


def _tag(param: nn.Parameter, **tags: object) -> nn.Parameter:
    for name, value in tags.items():
        setattr(param, name, value)
    return param


def _replace_parameters(layer: nn.Module, tensors: dict[str, torch.Tensor | None]) -> None:
    """Drop the checkpoint's parameters (the bias stays) and register `tensors` in their place."""
    for name in [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]:
        delattr(layer, name)
    for name, tensor in tensors.items():
        layer.register_parameter(name, None if tensor is None else nn.Parameter(tensor, requires_grad=False))


class _BnbMethod(QuantMethod):
    """What both bitsandbytes methods share: the kernel's weight or the dense fallback, and `apply`."""

    def __init__(self, layer_name: str) -> None:
        self.layer_name = layer_name
        self.weight_type = ""  # the kernel's weight type; "" for a layer dequantized to the model dtype
        self.model_dtype = torch.float32

    def _set_kernel_weight(self, layer: nn.Module, weight: ops.WNA16Weight) -> None:
        self.weight_type = weight.weight_type
        _replace_parameters(layer, {f"wna16_{name}": tensor
                                    for name, tensor in zip(("qweight", "scales", "zeros", "perm"), weight[:4],
                                                            strict=True)})

    def _set_dense_weight(self, layer: nn.Module, weight: torch.Tensor, why: str) -> None:
        logger.info("bitsandbytes layer %s dequantized to %s at load: %s", self.layer_name, self.model_dtype, why)
        self.weight_type = ""
        _replace_parameters(layer, {"weight": weight.to(self.model_dtype).contiguous()})

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.weight_type:
            return F.linear(x, layer.weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        out = ops.wna16_gemm(x2, layer.wna16_qweight, layer.wna16_scales, layer.wna16_zeros, layer.wna16_perm,
                             self.weight_type, x.dtype, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class BnbInt8LinearMethod(_BnbMethod):
    """LLM.int8 rows: int8 weights with per-row absmax `SCB`, run as W8A16 (scales `SCB / 127`)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        self.model_dtype = params_dtype
        N = sum(output_partition_sizes)
        layer.register_parameter("weight", _tag(nn.Parameter(torch.empty(N, input_size, dtype=torch.int8),
                                                             requires_grad=False), output_dim=0, input_dim=1))
        layer.register_parameter("SCB", _tag(nn.Parameter(torch.empty(N, dtype=torch.float32), requires_grad=False),
                                             output_dim=0))

        def check_format(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if loaded.numel() != 1 or int(loaded.reshape(-1)[0]) != _ROW_FORMAT:
                raise ValueError(f"{self.layer_name}.weight_format={loaded.reshape(-1).tolist()}: only row-major "
                                 f"int8 weights (format {_ROW_FORMAT}) load; bitsandbytes writes nothing else today")

        layer.register_parameter("weight_format", _tag(nn.Parameter(torch.empty(0, dtype=torch.uint8),
                                                                    requires_grad=False),
                                                       weight_loader=check_format, checkpoint_optional=True))

    def process_after_loading(self, layer: nn.Module) -> None:
        row_absmax = layer.SCB.detach()
        if not bool(torch.isfinite(row_absmax).all()):
            raise ValueError(f"{self.layer_name}.SCB must be finite")
        scales = (row_absmax / 127.0).reshape(-1, 1)
        values = layer.weight.detach()
        if values.shape[1] % GROUP_MULTIPLE:
            self._set_dense_weight(layer, values.float() * scales,
                                   f"{values.shape[1]} input features are not a multiple of {GROUP_MULTIPLE}")
            return
        self._set_kernel_weight(layer, ops.pack_wna16(values, scales, weight_type="int8",
                                                      scale_dtype=compact_dtype(scales, self.model_dtype)))


class Bnb4bitLinearMethod(_BnbMethod):
    """NF4 / FP4 blocks of bitsandbytes' 4-bit layers. `parts`: the checkpoint modules merged into the layer
    (q_proj, k_proj, v_proj), empty when the checkpoint stores the layer itself."""

    def __init__(self, layer_name: str, parts: Sequence[str], quant_type: str, double_quant: bool) -> None:
        super().__init__(layer_name)
        if quant_type not in QUANT_TYPES:
            raise ValueError(f"bitsandbytes quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")
        self.parts = tuple(parts)
        self.quant_type = quant_type
        self.double_quant = double_quant
        self._stash: dict[object, dict[str, torch.Tensor]] = {}  # shard id -> its small tensors as they arrive
        self._blocks: dict[int, _Blocks] = {}  # part index -> its decoded absmax

    @property
    def _suffixes(self) -> tuple[str, ...]:
        state = f"quant_state.bitsandbytes__{self.quant_type}"
        return (*_STATE_SUFFIXES, *(_NESTED_SUFFIXES if self.double_quant else ()), state)

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        if layer.input_size % 2 or input_size % 2:
            raise ConfigError(f"invalid shape for bitsandbytes layer {self.layer_name!r}: {input_size} input features "
                              "(per rank) are not whole bytes of two 4-bit codes")
        self.model_dtype = params_dtype
        N = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(N, input_size // 2, dtype=torch.uint8), requires_grad=False)
        layer.register_parameter("weight", _tag(weight, output_dim=0, input_dim=1, packed_dim=1, packed_factor=2,
                                                weight_loader=self._weight_loader(layer)))
        names = self.parts or (self.layer_name,)
        shard_ids = layer.shard_ids if self.parts else [None]
        for suffix in self._suffixes:
            placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            # Shapes for the record only: the placeholder keeps nothing, the stash checks what arrives.
            shards = {f"{name}.weight.{suffix}": (shard_id, (0,)) for name, shard_id in zip(names, shard_ids,
                                                                                          strict=True)}
            layer.register_parameter(f"bnb_{suffix.replace('.', '_')}",
                                     _tag(placeholder, checkpoint_shards=shards, weight_loader=self._stasher(layer,
                                                                                                           suffix)))

    def planned_weight_bytes(self, weight: nn.Parameter) -> tuple[int, int] | None:
        # Packed codes (the same bytes once repacked into int32 words) and float32 scales of 64-element blocks.
        N, half_k = weight.shape
        size = N * half_k + N * (2 * half_k // 64) * 4
        return size, size

    # ------------------------------------------------------------------------------------------ loading

    def _stored_rows(self, layer: nn.Module, shard_id: object) -> tuple[int, list[int]]:
        """(rows of the stored checkpoint tensor, the part indices it holds)."""
        sizes = layer.checkpoint_output_sizes()
        if shard_id is None:
            return sum(sizes), list(range(len(sizes)))
        index = layer.shard_index(shard_id)
        return sizes[index], [index]

    def _weight_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            rows, _ = self._stored_rows(layer, shard_id)
            packed = loaded.contiguous().view(torch.uint8).reshape(-1)  # any quant_storage dtype: its bytes
            if packed.numel() * 2 != rows * layer.input_size:
                raise ValueError(f"{self.layer_name}.weight (shard {shard_id!r}): {packed.numel()} bytes of 4-bit "
                                 f"codes, the module is [{rows}, {layer.input_size}]")
            layer.weight_loader(param, packed.reshape(rows, layer.input_size // 2), shard_id)

        return load

    def _stasher(self, layer: nn.Module, suffix: str):
        def stash(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            tensors = self._stash.setdefault(shard_id, {})
            tensors[suffix] = loaded.detach().cpu()
            if len(tensors) == len(self._suffixes):
                self._decode(layer, shard_id, self._stash.pop(shard_id))

        return stash

    def _decode(self, layer: nn.Module, shard_id: object, tensors: dict[str, torch.Tensor]) -> None:
        """One stored module's absmax, decoded and checked against its JSON; each of its parts keeps what this rank
        needs."""
        where = f"{self.layer_name} (shard {shard_id!r})" if shard_id is not None else self.layer_name
        state_key = self._suffixes[-1]
        state = json.loads(tensors[state_key].to(torch.uint8).numpy().tobytes().decode("utf-8"))
        rows, part_indices = self._stored_rows(layer, shard_id)
        K = layer.input_size
        if state.get("quant_type") != self.quant_type:
            raise ValueError(f"{where}: weight.{state_key} says quant_type={state.get('quant_type')!r}, the "
                             f"quantization_config bnb_4bit_quant_type={self.quant_type!r}")
        if list(state.get("shape") or ()) != [rows, K]:
            raise ValueError(f"{where}: weight.{state_key} says shape {state.get('shape')}, the module is "
                             f"[{rows}, {K}]")
        blocksize = state.get("blocksize")
        if not isinstance(blocksize, int) or blocksize <= 0:
            raise ValueError(f"{where}: weight.{state_key} has blocksize={blocksize!r}")
        if ("nested_offset" in state) != self.double_quant:
            raise ValueError(f"{where}: weight.{state_key} {'has' if 'nested_offset' in state else 'lacks'} nested "
                             f"absmax settings, and bnb_4bit_use_double_quant={self.double_quant}")
        book = torch.tensor(_CODE_BOOK[self.quant_type], dtype=torch.float32)
        quant_map = tensors["quant_map"].float().reshape(-1)
        if not torch.equal(quant_map, book):
            raise ValueError(f"{where}: weight.quant_map is not bitsandbytes' {self.quant_type} code book (which "
                             "bitsandbytes itself decodes with whatever the file says)")
        absmax = self._absmax(tensors, state, where, -(-rows * K // blocksize))
        offset = 0
        for index in part_indices:
            self._blocks[index] = self._rank_share(layer, index, _Blocks(blocksize, absmax, offset))
            offset += layer.checkpoint_output_sizes()[index]

    def _absmax(self, tensors: dict[str, torch.Tensor], state: dict, where: str, blocks: int) -> torch.Tensor:
        absmax = tensors["absmax"].reshape(-1)
        if absmax.numel() != blocks:
            raise ValueError(f"{where}: weight.absmax has {absmax.numel()} entries, the module has {blocks} blocks")
        if not self.double_quant:
            absmax = absmax.float()
        else:
            nested_blocksize = state.get("nested_blocksize")
            if not isinstance(nested_blocksize, int) or nested_blocksize <= 0:
                raise ValueError(f"{where}: nested_blocksize={nested_blocksize!r}")
            code = tensors["nested_quant_map"].float().reshape(-1)
            nested = tensors["nested_absmax"].float().reshape(-1)
            if absmax.dtype != torch.uint8 or code.numel() != 256 or nested.numel() != -(-blocks // nested_blocksize):
                raise ValueError(f"{where}: double-quantized absmax must be uint8 codes into a 256-entry "
                                 f"nested_quant_map with one nested_absmax per {nested_blocksize} blocks")
            # bitsandbytes' order, in float32: the code times its block's absmax, then the offset.
            per_block = nested.repeat_interleave(nested_blocksize)[:blocks]
            absmax = code[absmax.long()] * per_block + torch.tensor(float(state["nested_offset"]), dtype=torch.float32)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError(f"{where}: weight.absmax must be finite")
        return absmax

    def _rank_share(self, layer: nn.Module, index: int, blocks: _Blocks) -> _Blocks:
        """Where the part's blocks are groups of this rank's input features, its group scales (the whole absmax is
        dropped); otherwise the whole absmax, for the dense fallback."""
        K, K_rank, bs = layer.input_size, layer.input_size_per_partition, blocks.blocksize
        if K % bs or K_rank % bs or bs % GROUP_MULTIPLE:
            return blocks
        r0, c0 = self._origin(layer, index, blocks.row_offset)
        n = layer.output_partition_sizes[index]
        scales = blocks.absmax.reshape(-1, K // bs)[r0:r0 + n, c0 // bs:(c0 + K_rank) // bs]
        return _Blocks(bs, scales=scales.contiguous())

    @staticmethod
    def _origin(layer: nn.Module, index: int, row_offset: int) -> tuple[int, int]:
        """(first row, first column) of this rank's share of a part within its stored tensor."""
        column_split, row_split = _split(layer)
        r0 = row_offset + (layer.tp_rank * layer.output_partition_sizes[index] if column_split else 0)
        c0 = layer.tp_rank * layer.input_size_per_partition if row_split else 0
        return r0, c0

    # ------------------------------------------------------------------------------------ after loading

    def process_after_loading(self, layer: nn.Module) -> None:
        count = len(layer.output_partition_sizes)
        if self._stash or len(self._blocks) != count:
            raise ValueError(f"{self.layer_name}: the 4-bit state of some parts is incomplete "
                             f"({sorted(map(str, self._stash))} partly loaded)")
        packed = layer.weight.detach().to(torch.int32)
        codes = torch.stack((packed >> 4, packed & 0xF), dim=2).reshape(packed.shape[0], -1)  # high nibble first
        blocks = [self._blocks[i] for i in range(count)]
        sizes = {b.blocksize for b in blocks}
        if len(sizes) == 1 and all(b.scales is not None for b in blocks):
            scales = torch.cat([b.scales for b in blocks]).to(codes.device)
            self._set_kernel_weight(layer, ops.pack_wna16(codes, scales, weight_type=_WEIGHT_TYPE[self.quant_type],
                                                          scale_dtype=compact_dtype(scales, self.model_dtype)))
        else:
            why = (f"blocks of {sorted(sizes)} elements are not groups of whole rows of this rank's "
                   f"{layer.input_size_per_partition} input features")
            self._set_dense_weight(layer, self._dequantize(layer, codes, blocks), why)
        self._blocks.clear()

    def _dequantize(self, layer: nn.Module, codes: torch.Tensor, blocks: list[_Blocks]) -> torch.Tensor:
        """float32 `[N_rank, K_rank]`: code value times its block's absmax (bitsandbytes' own float32 product)."""
        book = torch.tensor(_CODE_BOOK[self.quant_type], dtype=torch.float32, device=codes.device)
        K, K_rank = layer.input_size, layer.input_size_per_partition
        out, first = [], 0
        for index, b in enumerate(blocks):
            n = layer.output_partition_sizes[index]
            part = book[codes[first:first + n].long()]
            if b.scales is not None:
                scale = b.scales.to(codes.device).repeat_interleave(b.blocksize, dim=1)
            else:
                r0, c0 = self._origin(layer, index, b.row_offset)
                rows = torch.arange(r0, r0 + n, device=codes.device).view(-1, 1)
                cols = torch.arange(c0, c0 + K_rank, device=codes.device).view(1, -1)
                scale = b.absmax.to(codes.device)[(rows * K + cols) // b.blocksize]
            out.append(part * scale)
            first += n
        return torch.cat(out)
