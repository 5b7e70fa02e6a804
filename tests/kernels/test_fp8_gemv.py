"""The FP8 weight GEMV (`kernels/fp8_gemv.py`): the kernel (interpreted on CPU) and its reference against a float64
oracle on the dequantized weights and unquantized activations (W8A16), the table-driven selection, and the FP8
linear layer's use of it (its producers then emit model-dtype activations for that M, 8-bit ones above it).
Shapes are small and off the tiles' multiples (partial N blocks, K tails)."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels import common
from kestrel.kernels import fp8_gemv as fg

TILES = fg.FP8GemvConfig(block_n=8, block_k=16, num_warps=1, max_m=8)
SPLIT = fg.FP8GemvConfig(block_n=16, block_k=16, split_k=3, num_warps=1, max_m=8)
# Tensor-core steps from M = 2 (16-bit activations; fp32 ones keep the FMA loop), with split-K.
DOT = fg.FP8GemvConfig(block_n=16, block_k=32, split_k=2, num_warps=1, max_m=8, dot_from_m=2)


def make(M: int, N: int, K: int, dtype: torch.dtype, per_tensor: bool, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g)
    if per_tensor:
        scale = (w.abs().amax() / 448.0).reshape(1)
    else:
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, q, scale.float(), b


def oracle(x, q, scale, b) -> torch.Tensor:
    out = x.double() @ (q.double() * scale.double().reshape(-1, 1)).T
    return out + b.double() if b is not None else out


def check(out: torch.Tensor, ref64: torch.Tensor, out_dtype: torch.dtype, K: int) -> None:
    assert out.dtype == out_dtype
    # One rounding to the output plus fp32 accumulation over K terms.
    eps = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-24 * K * 4
    bound = eps * ref64.abs() + 2.0**-20 * K * ref64.abs().max()
    assert bool(((out.double() - ref64).abs() <= bound + 1e-30).all()), (out.double() - ref64).abs().max()


CASES = [  # (M, N, K, x dtype, out dtype, per_tensor, bias)
    (1, 24, 40, torch.bfloat16, torch.bfloat16, False, False),
    (2, 17, 64, torch.bfloat16, torch.float32, True, True),
    (3, 40, 50, torch.float16, torch.bfloat16, False, True),
    (5, 9, 33, torch.float32, torch.float32, False, False),
    (8, 32, 48, torch.bfloat16, torch.bfloat16, True, False),
    (11, 16, 24, torch.bfloat16, torch.float32, False, True),  # past MAX_M: chunks of 8 rows
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_and_reference_match_oracle(case, device):
    M, N, K, dtype, out_dtype, per_tensor, bias = case
    x, q, scale, b = make(M, N, K, dtype, per_tensor, bias, seed=M * 100 + N + K)
    ref64 = oracle(x, q, scale, b)
    on = [t.to(device) if t is not None else None for t in (x, q, scale, b)]
    for cfg in (TILES, SPLIT, DOT):
        check(fg.fp8_gemv(*on[:3], out_dtype, on[3], config=cfg).cpu(), ref64, out_dtype, K)
    check(fg.fp8_gemv_ref(x, q, scale, out_dtype, b), ref64, out_dtype, K)


def test_all_m_one_to_eight(device):
    x, q, scale, b = make(8, 20, 36, torch.bfloat16, False, True, seed=7)
    on = [t.to(device) for t in (x, q, scale, b)]
    for M in range(1, 9):
        for cfg in (TILES, DOT):
            out = fg.fp8_gemv(on[0][:M], *on[1:3], torch.float32, on[3], config=cfg).cpu()
            check(out, oracle(x[:M], q, scale, b), torch.float32, 36)


def test_rejects_bad_arguments():
    x, q, scale, _ = make(1, 8, 16, torch.bfloat16, False, False, seed=1)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fg.fp8_gemv_ref(x, q.float(), scale, torch.bfloat16)
    with pytest.raises(ValueError, match="weight_scale"):
        fg.fp8_gemv_ref(x, q, scale[:3], torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        fg.fp8_gemv_ref(x[:, :8], q, scale, torch.bfloat16)


# ------------------------------------------------------------------------------------------ selection

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_table(monkeypatch):
    """The GPU table reader returning a given table for fp8_gemv (and {} for other kernels)."""
    tables: dict[str, dict] = {}

    def gpu_table(kernel: str, device: torch.device) -> dict:
        return tables.get(kernel, {}) if device.type == "cuda" else {}

    monkeypatch.setattr(common, "gpu_table", gpu_table)
    return tables


def test_selection_off_without_a_table(fake_table):
    assert fg.select_gemv(1, 64, 32, CUDA) is None
    assert fg.select_gemv(1, 64, 32, torch.device("cpu")) is None


def test_selection_by_table_and_max_m(fake_table):
    fake_table[fg.TABLE] = {fg.table_key(64, 32): dict(TILES.to_json(), max_m=4)}
    assert fg.select_gemv(1, 64, 32, CUDA) == fg.FP8GemvConfig(**dict(TILES.to_json(), max_m=4))
    assert fg.select_gemv(4, 64, 32, CUDA) is not None
    assert fg.select_gemv(5, 64, 32, CUDA) is None
    assert fg.select_gemv(0, 64, 32, CUDA) is None
    assert fg.select_gemv(1, 32, 64, CUDA) is None  # another shape
    fake_table[fg.TABLE] = {fg.table_key(64, 32): dict(TILES.to_json(), max_m=0)}
    assert fg.select_gemv(1, 64, 32, CUDA) is None


def test_real_table_reader_off_cuda():
    assert common.gpu_table(fg.TABLE, torch.device("cpu")) == {}
    assert fg.select_gemv(1, 4096, 4096, torch.device("cpu")) is None
