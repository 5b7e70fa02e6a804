"""The decode GEMV (`kernels/gemv.py`) for FP8 and 16-bit weights: the kernel (interpreted on CPU) and its reference
against a float64 oracle on the dequantized weights and unquantized activations (W8A16 for FP8), one K slice and
several (the last-arrival split sum), and the table-driven selection. Shapes are small and off the slices'
multiples (partial N blocks, K tails)."""

from __future__ import annotations

import pytest
import sm90
import torch

from kestrel.kernels import common
from kestrel.kernels import gemv as gv

ONE_SLICE = gv.GemvConfig(block_n=8, block_k=64, num_warps=1, max_m=8)
SPLIT = gv.GemvConfig(block_n=16, block_k=16, num_warps=1, max_m=8)  # K / 16 slices summed by the last arrival
NARROW = gv.GemvConfig(block_n=2, block_k=32, num_warps=1, max_m=8)


def make(M: int, N: int, K: int, dtype: torch.dtype, weight: str, per_tensor: bool, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    if weight != "fp8":
        return x, w.to(getattr(torch, weight)), None, b
    if per_tensor:
        scale = (w.abs().amax() / 448.0).reshape(1)
    else:
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return x, q, scale.float(), b


def oracle(x, w, scale, b) -> torch.Tensor:
    w64 = w.double() if scale is None else w.double() * scale.double().reshape(-1, 1)
    out = x.double() @ w64.T
    return out + b.double() if b is not None else out


def check(out: torch.Tensor, ref64: torch.Tensor, out_dtype: torch.dtype, K: int) -> None:
    assert out.dtype == out_dtype
    # One rounding to the output plus fp32 accumulation over K terms.
    eps = 2.0**-8 if out_dtype in (torch.bfloat16, torch.float16) else 2.0**-24 * K * 4
    bound = eps * ref64.abs() + 2.0**-20 * K * ref64.abs().max()
    assert bool(((out.double() - ref64).abs() <= bound + 1e-30).all()), (out.double() - ref64).abs().max()


CASES = [  # (M, N, K, x dtype, weight, out dtype, per_tensor, bias)
    (1, 24, 40, torch.bfloat16, "fp8", torch.bfloat16, False, False),
    (2, 17, 64, torch.bfloat16, "fp8", torch.float32, True, True),
    (3, 40, 50, torch.float16, "fp8", torch.bfloat16, False, True),
    (5, 9, 33, torch.float32, "fp8", torch.float32, False, False),
    (8, 32, 48, torch.bfloat16, "fp8", torch.bfloat16, True, False),
    (11, 16, 24, torch.bfloat16, "fp8", torch.float32, False, True),  # past MAX_M: chunks of 8 rows
    (1, 24, 40, torch.bfloat16, "bfloat16", torch.bfloat16, False, True),
    (3, 19, 72, torch.bfloat16, "bfloat16", torch.float32, False, False),
    (2, 33, 48, torch.float16, "float16", torch.float16, False, True),
    (9, 8, 20, torch.float32, "bfloat16", torch.float32, False, False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_and_reference_match_oracle(case, device):
    M, N, K, dtype, weight, out_dtype, per_tensor, bias = case
    x, w, scale, b = make(M, N, K, dtype, weight, per_tensor, bias, seed=M * 100 + N + K)
    ref64 = oracle(x, w, scale, b)
    on = [t.to(device) if t is not None else None for t in (x, w, scale, b)]
    for cfg in (ONE_SLICE, SPLIT, NARROW):
        check(gv.gemv(*on[:3], out_dtype, on[3], config=cfg).cpu(), ref64, out_dtype, K)
    check(gv.gemv_ref(x, w, scale, out_dtype, b), ref64, out_dtype, K)


def test_all_m_one_to_eight_and_the_counters_left_zeroed(device):
    x, q, scale, b = make(8, 20, 36, torch.bfloat16, "fp8", False, True, seed=7)
    on = [t.to(device) for t in (x, q, scale, b)]
    for M in range(1, 9):
        for cfg in (ONE_SLICE, SPLIT):
            out = gv.gemv(on[0][:M], *on[1:3], torch.float32, on[3], config=cfg).cpu()
            check(out, oracle(x[:M], q, scale, b), torch.float32, 36)
    assert int(common.arrival_counters(torch.device(device)).count_nonzero()) == 0


def test_split_sum_is_deterministic(device):
    x, w, _, _ = make(2, 40, 200, torch.bfloat16, "bfloat16", False, False, seed=9)
    x, w = x.to(device), w.to(device)
    first = gv.gemv(x, w, None, torch.float32, config=SPLIT)
    for _ in range(3):
        assert torch.equal(gv.gemv(x, w, None, torch.float32, config=SPLIT), first)


def test_rejects_bad_arguments():
    x, q, scale, _ = make(1, 8, 16, torch.bfloat16, "fp8", False, False, seed=1)
    with pytest.raises(ValueError, match="float8_e4m3fn, bfloat16 or float16"):
        gv.gemv_ref(x, q.float(), scale, torch.bfloat16)
    with pytest.raises(ValueError, match="weight_scale"):
        gv.gemv_ref(x, q, scale[:3], torch.bfloat16)
    with pytest.raises(ValueError, match="needs its weight_scale"):
        gv.gemv_ref(x, q, None, torch.bfloat16)
    with pytest.raises(ValueError, match="takes none"):
        gv.gemv_ref(x, q.to(torch.bfloat16), scale, torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        gv.gemv_ref(x[:, :8], q, scale, torch.bfloat16)


# ------------------------------------------------------------------------------------------ routing

ROUTE_CASES = [  # (M, experts, K, top_k, renormalize, x dtype)
    (1, 24, 40, 4, True, torch.bfloat16),
    (3, 16, 72, 2, False, torch.bfloat16),
    (2, 33, 48, 8, True, torch.float16),
    (11, 8, 20, 8, True, torch.bfloat16),  # past MAX_M: each chunk of rows routes in its own launch
]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=str)
def test_routing_in_the_last_column_block_is_the_routing_launch_bit_for_bit(case, device):
    """`gemv_route` (the router GEMV whose last column block to be stored routes every row) gives the weights and
    ids of the GEMV followed by the routing launch, bit for bit, on one K slice, on several (the split sum's last
    arrival then routes) and on many column blocks; the counters are left zeroed; and the reference is the
    float64 router's softmax top-k."""
    from kestrel.kernels import moe_routing

    M, E, K, top_k, renormalize, dtype = case
    g = torch.Generator().manual_seed(M * 1000 + E + K)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(E, K, generator=g) / K**0.5).to(dtype).to(device)
    for cfg in (ONE_SLICE, SPLIT, NARROW):
        weights, ids = gv.gemv_route(x, w, top_k, renormalize, config=cfg)
        two_launches = moe_routing.route_topk(gv.gemv(x, w, None, dtype, config=cfg), top_k, renormalize)
        assert torch.equal(weights, two_launches[0]) and torch.equal(ids, two_launches[1])
    assert int(common.arrival_counters(torch.device(device)).count_nonzero()) == 0
    ref_weights, ref_ids = gv.gemv_route_ref(x.cpu(), w.cpu(), top_k, renormalize)
    probs64 = torch.softmax(x.cpu().double() @ w.cpu().double().T, dim=-1)
    oracle_ids = torch.topk(probs64, top_k, dim=-1).indices
    # The logits are rounded to x's dtype first: a near tie may swap, so compare the chosen probabilities.
    assert torch.allclose(probs64.gather(1, ref_ids), probs64.gather(1, oracle_ids), rtol=2.0**-6, atol=1e-6)
    assert torch.allclose(weights.cpu(), ref_weights, rtol=2.0**-20, atol=1e-7)
    assert torch.equal(ids.cpu(), ref_ids)


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_routing_in_the_last_column_block_is_the_routing_launch_bit_for_bit(renormalize, device):
    """The router GEMV's own routing with sigmoid scores: the routing launch's weights and ids, the reference's."""
    from kestrel.kernels import moe_routing

    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(16, 64, generator=g) / 8).to(torch.bfloat16).to(device)
    for cfg in (ONE_SLICE, SPLIT, NARROW):
        weights, ids = gv.gemv_route(x, w, 4, renormalize, config=cfg, scoring="sigmoid")
        two_launches = moe_routing.route_topk(gv.gemv(x, w, None, torch.bfloat16, config=cfg), 4, renormalize,
                                              "sigmoid")
        assert torch.equal(weights, two_launches[0]) and torch.equal(ids, two_launches[1])
    ref_weights, ref_ids = gv.gemv_route_ref(x.cpu(), w.cpu(), 4, renormalize, scoring="sigmoid")
    assert torch.equal(ids.cpu(), ref_ids)
    assert torch.allclose(weights.cpu(), ref_weights, rtol=2.0**-20, atol=1e-7)


def _route_sm90_reports() -> list[tuple[str, str]]:
    """(PTX, ptxas report) of the routing GEMV at Qwen3-30B-A3B's router (128 experts x 2048, top-8) with the H200
    table's tiles (one K slice) and with two K slices (the routing inside the split sum's last arrival), 1 and 4
    rows. Run in a process without TRITON_INTERPRET (see the test)."""
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
                "ws_ptr": "*fp32", "lock_ptr": "*i32", "route_w_ptr": "*fp32", "route_id_ptr": "*i64"}
    ints = ["N", "K", "stride_xm", "stride_wn", "stride_om"]
    reports = []
    for block_k, rows, sigmoid in ((2048, 1, False), (2048, 4, False), (1024, 4, False), (1024, 4, True)):
        constexprs = dict(SPLIT_K=2048 // block_k, ROWS=rows, W_FP8=False, HAS_SCALE=False, PER_TENSOR=False,
                          HAS_BIAS=False, EVEN_K=True, USE_PDL=True, FAST=True, BLOCK_N=2, BLOCK_K=block_k,
                          NUM_BLOCKS=64, TOP_K=8, K_PAD=8, E_PAD=128, RENORMALIZE=True,
                          SIGMOID=sigmoid)
        reports.append(sm90.compile_sm90(gv._gemv_kernel, pointers, ints, constexprs, 4))
    return reports


def test_routing_gemv_compiles_for_sm90_without_spills():
    """The interpreter runs what the GPU compiler may still refuse: the routing GEMV compiled for the H200 (ptxas
    ships with Triton), in a process of their own since this one's kernels are interpreted."""
    *softmax, sigmoid = sm90.reports("test_gemv", "_route_sm90_reports()")
    for (ptx, report), rows in zip(softmax, (1, 4, 4), strict=True):
        assert " 0 bytes spill stores" in report, report
        # the arrival counted with acquire-release order, and one softmax (one ex2) per routed row
        assert "atom.global.gpu.acq_rel.add" in ptx and ptx.count("ex2") == rows
    # sigmoid scores (4 rows): no spills either
    assert " 0 bytes spill stores" in sigmoid[1], sigmoid[1]


def test_routing_refuses_what_it_cannot_route():
    x, w = torch.randn(1, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    with pytest.raises(ValueError, match="top_k=9 must be in 1..8"):
        gv.gemv_route(x, w, 9, True)
    with pytest.raises(ValueError, match="16-bit"):
        gv.gemv_route(x, w.to(torch.float8_e4m3fn), 2, True)


# ------------------------------------------------------------------------------------------ selection

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_table(monkeypatch):
    """The GPU table reader returning a given table for the GEMV (and {} for other kernels)."""
    tables: dict[str, dict] = {}

    def gpu_table(kernel: str, device: torch.device) -> dict:
        return tables.get(kernel, {}) if device.type == "cuda" else {}

    monkeypatch.setattr(common, "gpu_table", gpu_table)
    return tables


class _Weight:
    """Enough of a tensor for `table_config`: shape, dtype, device (no CUDA tensor on the CPU machine)."""

    def __init__(self, N: int, K: int, dtype: torch.dtype, device: torch.device = CUDA):
        self.shape, self.dtype, self.device = (N, K), dtype, device

    def dim(self) -> int:
        return 2


def select(M: int, N: int, K: int, dtype: torch.dtype = torch.float8_e4m3fn, device=CUDA):
    cfg = gv.table_config(_Weight(N, K, dtype, device))
    return cfg if gv.takes_rows(cfg, M) else None


def test_selection_off_without_a_table(fake_table):
    assert select(1, 64, 32) is None
    assert select(1, 64, 32, device=torch.device("cpu")) is None


def test_selection_by_kind_table_and_max_m(fake_table):
    fake_table[gv.TABLE] = {gv.table_key("fp8", 64, 32): dict(ONE_SLICE.to_json(), max_m=4)}
    assert select(1, 64, 32) == gv.GemvConfig(**dict(ONE_SLICE.to_json(), max_m=4))
    assert select(4, 64, 32) is not None
    assert select(5, 64, 32) is None
    assert select(0, 64, 32) is None
    assert select(1, 32, 64) is None  # another shape
    assert select(1, 64, 32, torch.bfloat16) is None  # another kind
    fake_table[gv.TABLE][gv.table_key("w16", 64, 32)] = dict(SPLIT.to_json(), max_m=2)
    assert select(2, 64, 32, torch.bfloat16) == gv.GemvConfig(**dict(SPLIT.to_json(), max_m=2))
    assert select(2, 64, 32, torch.float16) is not None
    assert select(1, 64, 32, torch.float32) is None  # no fp32 weights on this path
    fake_table[gv.TABLE] = {gv.table_key("fp8", 64, 32): dict(ONE_SLICE.to_json(), max_m=0)}
    assert select(1, 64, 32) is None


def test_real_table_reader_off_cuda():
    assert common.gpu_table(gv.TABLE, torch.device("cpu")) == {}
    assert select(1, 4096, 4096, device=torch.device("cpu")) is None
