"""The CPU linear fast path (kernels/cpu/linear.py, oneDNN with bucketed rows) against `F.linear` in float64, and the
bound on the distinct shapes it hands oneDNN (each one a primitive held for the process's life)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel import ops
from kestrel.kernels.cpu import linear as cpu_linear
from kestrel.kernels.cpu.linear import linear_cpu


@pytest.mark.parametrize("rows,k,n", [(1, 256, 8192), (15, 64, 40), (16, 64, 40), (64, 256, 1280), (7, 640, 256),
                                      (300, 64, 48), (2048, 32, 24), (4500, 32, 24), (2060, 32, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_float64(rows: int, k: int, n: int, with_bias: bool, packed: bool) -> None:
    gen = torch.Generator().manual_seed(rows + k + n)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if with_bias else None
    got = linear_cpu(x, w, b, cpu_linear.pack_weight(w) if packed else None)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_leading_dims_and_strided_input() -> None:
    x = torch.randn(3, 20, 40)[:, :, :32]  # rows not contiguous
    w = torch.randn(24, 32)
    torch.testing.assert_close(linear_cpu(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert linear_cpu(torch.empty(0, 32), w).shape == (0, 24)


def test_onednn_sees_only_bucketed_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: set[int] = set()
    real = cpu_linear._onednn_linear

    def recording(x, weight, bias):
        seen.add(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(cpu_linear, "_onednn_linear", recording)
    w = torch.randn(8, 16)
    packed = cpu_linear.pack_weight(w)
    for rows in range(1, 5000, 7):
        linear_cpu(torch.randn(rows, 16), w)
        linear_cpu(torch.randn(rows, 16), w, packed=packed)
    assert seen <= set(cpu_linear.ROW_BUCKETS) and cpu_linear.ROW_BUCKETS == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert all(r <= cpu_linear.row_bucket(r) < 2 * r for r in range(16, 2049))  # under twice the rows


@pytest.mark.parametrize("rows", [*range(1, 300), 1600, 2047, 2048, 2049, 4096 + 100, 6400])
def test_row_pieces_cover_the_rows_with_little_padding(rows: int) -> None:
    pieces = cpu_linear.row_pieces(rows)
    assert [p[0] for p in pieces] == [sum(p[1] for p in pieces[:i]) for i in range(len(pieces))]
    assert sum(p[1] for p in pieces) == rows
    *full, (_, last, last_bucket) = pieces
    assert all(count == bucket for _, count, bucket in full)
    assert last <= last_bucket
    # padding only on the last piece: under 64 rows, or at most an eighth of its bucket
    assert last_bucket == last or last_bucket <= 64 or (last_bucket - last) * 8 <= last_bucket
    assert len(pieces) <= rows // cpu_linear.MAX_ROWS + 1 + 5  # at most one cut per octave from 2048 to 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_are_f_linear(dtype: torch.dtype) -> None:
    x, w = torch.randn(40, 16, dtype=dtype), torch.randn(8, 16, dtype=dtype)
    assert torch.equal(linear_cpu(x, w), F.linear(x, w))


def test_autograd_takes_f_linear() -> None:
    x = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(8, 16)
    linear_cpu(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(40, 16))


def test_packed_weights_only_where_the_fast_path_applies() -> None:
    assert cpu_linear.pack_weight(torch.randn(8, 16, dtype=torch.bfloat16)) is None
    assert cpu_linear.pack_weight(torch.randn(16, 8).t()) is None  # not contiguous
    assert ops.pack_linear_weight(torch.randn(8, 16)) is not None


def test_unquantized_layers_keep_a_packed_weight_after_loading() -> None:
    from kestrel.model.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(32, 24, bias=False, params_dtype=torch.float32)
    layer.weight.data.copy_(torch.randn(24, 32))
    layer.quant_method.process_after_loading(layer)
    assert layer.cpu_packed_weight is not None
    x = torch.randn(40, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_ops_linear_uses_f_linear_under_cpu_references() -> None:
    x, w = torch.randn(64, 256), torch.randn(1280, 256)
    with ops.cpu_references():
        assert torch.equal(ops.linear(x, w), F.linear(x, w))
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
