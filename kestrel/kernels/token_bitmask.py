"""Grammar bitmasks applied to logits in place: bit t % 32 of int32 word t // 32 set = token t allowed (xgrammar's
layout). Disallowed tokens, and tokens past the mask's 32 x W (padded vocabularies), get -inf.

The Triton kernel is one launch that reads the mask and writes -inf only where a token is disallowed; the
reference unpacks the mask to booleans and rewrites the masked rows (about ten launches and 250 MB of traffic at
64 rows of a 128k vocabulary)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab_size]; tokens past the mask's 32 x W are disallowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mask `logits[rows[i]]` by `bitmask[i]` (in place) and return `logits`."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)


# ------------------------------------------------------------------------------------------------ Triton

_BLOCK_WORDS = 64  # 2,048 tokens a program


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab_size, num_words, stride_logits,
                                stride_mask, BLOCK_WORDS: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    words = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    bits = tl.load(bitmask_ptr + i * stride_mask + words, mask=words < num_words, other=0)
    tokens = words[:, None] * 32 + tl.arange(0, 32)[None, :]
    allowed = ((bits[:, None] >> tl.arange(0, 32)[None, :]) & 1) != 0
    ninf = tl.full([BLOCK_WORDS, 32], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + tokens, ninf, mask=(tokens < vocab_size) & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The reference's contract in one launch: `logits [R, V]` (rows contiguous), `bitmask` int32 `[n, W]`,
    `rows` `[n]` distinct row indices of `logits`."""
    n = rows.shape[0]
    if n == 0:
        return logits
    assert logits.stride(-1) == 1 and bitmask.dtype == torch.int32 and bitmask.stride(-1) == 1
    vocab = logits.shape[-1]
    grid = (n, triton.cdiv(triton.cdiv(vocab, 32), _BLOCK_WORDS))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows, vocab, bitmask.shape[1], logits.stride(0),
                                      bitmask.stride(0), BLOCK_WORDS=_BLOCK_WORDS)
    return logits
