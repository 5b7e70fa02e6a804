"""apply_token_bitmask: the Triton kernel (interpreted on CPU) and its reference against an oracle that tests each
token's bit one by one in Python: allowed logits keep their bits, disallowed ones and tokens past the mask become
-inf, rows not named keep every byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kestrel.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref


def oracle(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    expected = logits.clone()
    words = bitmask.numpy().astype(np.int64) & 0xFFFFFFFF
    for i, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = token // 32
            allowed = word < words.shape[1] and (int(words[i, word]) >> (token % 32)) & 1
            if not allowed:
                expected[row, token] = float("-inf")
    return expected


@pytest.mark.parametrize("impl", [apply_token_bitmask, apply_token_bitmask_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "words", "rows"), [
    (100, 4, [0, 1, 2]),          # vocabulary inside the mask's last word
    (96, 3, [2, 0]),              # rows out of order, one left alone
    (130, 4, [1]),                # tokens past 32 x W are disallowed
    (2100, 66, [3, 0, 4]),        # more than one program along the vocabulary
])
def test_matches_oracle(impl, dtype, vocab, words, rows):
    g = torch.Generator().manual_seed(vocab + len(rows))
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -1  # every bit, the sign bit included
    bitmask[-1, -1] = 0
    expected = oracle(logits, bitmask, rows)
    out = impl(logits, bitmask, torch.tensor(rows, dtype=torch.long))
    assert out.data_ptr() == logits.data_ptr()  # in place
    assert torch.equal(logits.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.long))
    assert torch.equal(logits, before)
