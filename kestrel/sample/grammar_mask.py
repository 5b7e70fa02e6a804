"""Grammar bitmasks applied to logits on the device: bit t % 32 of int32 word t // 32 set = token t allowed
(xgrammar's layout). Disallowed tokens get -inf, so every later step (greedy, temperature, top-p/top-k,
logprobs) sees the masked distribution."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab_size]; tokens past the mask's 32 x W (padded vocabularies) are disallowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mask `logits[rows[i]]` by `bitmask[i]` (in place) and return `logits`."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)
