"""rope_store_kv: the Triton kernel (interpreted on CPU) and its reference against a float64 oracle.

The oracle rotates in float64 with the (float32) cos/sin tables it is given, which are built here from
float64 angles independently of `RotaryEmbedding`. The op rotates in fp32 and rounds once, so:
- q: `|out - y| <= u * |y|` (u: unit roundoff of q's dtype) plus fp32 slack on the rotation's terms;
  dims past rotary_dim are copied exactly.
- K cache: the same bound in the cache's dtype; an FP8 cache holds `y / k_scale` rounded once to e4m3
  (half a step: 2^-4 relative, 2^-10 absolute among subnormals), saturated to +-448.
- V cache: an exact copy in the input dtype; FP8 as for K, without the rotation.
Cache slots not named by the slot mapping (slot -1 rows, other slots) keep their bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest
import sm90
import torch
import triton
import triton.language as tl

from kestrel.kernels import rope_kv
from kestrel.kernels.rope_kv import HeadNorms, head_norms_ref, rope_store_kv, rope_store_kv_ref

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32 = 2.0**-24
E4M3_UNIT, E4M3_SUBNORMAL_HALF_STEP, E4M3_MAX = 2.0**-4, 2.0**-10, 448.0
FP8 = torch.float8_e4m3fn
NUM_BLOCKS, BLOCK_SIZE, MAX_POSITION = 9, 5, 4096


@dataclass(frozen=True)
class Case:
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rotary_dim: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    k_scale: float = 1.0
    v_scale: float = 1.0


def tables(rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


class Inputs:
    """q, k, v as column slices of one qkv tensor (strided rows), positions, scattered slots with -1 rows,
    and caches full of random values that unwritten slots must keep."""

    def __init__(self, case: Case, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        c = self.case = case
        self.widths = [c.num_heads * c.head_size, c.num_kv_heads * c.head_size, c.num_kv_heads * c.head_size]
        qkv = torch.randn(c.num_tokens, sum(self.widths) + 3, generator=g) * 2
        if c.cache_dtype == FP8:  # saturate: a large k head (any rotation of it) and large v entries
            qkv[0, self.widths[0]:self.widths[0] + c.head_size] = 300.0
            qkv[0, sum(self.widths[:2]):sum(self.widths[:2]) + 4] = torch.tensor([1000.0, -1000.0, 100.0, -0.01])
        self.qkv = qkv.to(c.dtype)
        self.positions = torch.randint(0, MAX_POSITION, (c.num_tokens,), generator=g)
        self.positions[0] = MAX_POSITION - 1
        self.slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:c.num_tokens]
        self.slots[1::3] = -1
        self.cos, self.sin = tables(c.rotary_dim)
        shape = (NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_size)
        self.caches = [torch.randn(shape, generator=g).to(c.cache_dtype) for _ in range(2)]

    def split(self, device: torch.device) -> list[torch.Tensor]:
        """Moved as one tensor, then sliced on the device, so the slices keep their strides there."""
        qkv = self.qkv.to(device)[:, :sum(self.widths)]
        q, k, v = qkv.split(self.widths, dim=1)
        assert q.stride(0) == sum(self.widths) + 3
        return [q, k, v]

    def run(self, fn, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.case
        k_cache, v_cache = (x.clone().to(device) for x in self.caches)
        q, k, v = self.split(device)
        out = fn(self.positions.to(device), q, k, v, self.cos.to(device), self.sin.to(device), c.rotary_dim,
                 k_cache, v_cache, self.slots.to(device), c.k_scale, c.v_scale)
        assert torch.equal(self.qkv.to(device)[:, :sum(self.widths)], torch.cat([q, k, v], dim=1)), "inputs changed"
        return out.cpu(), k_cache.cpu(), v_cache.cpu()


def rotate_oracle(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  rotary_dim: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 `[T, heads, D]` rotation and the magnitude of its terms (the scale of fp32 rounding errors)."""
    x = x.double().reshape(x.shape[0], -1, head_size)
    c, s = cos[positions].double()[:, None, :], sin[positions].double()[:, None, :]
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    y, mag = x.clone(), x.abs()
    y[..., :half], y[..., half:rotary_dim] = x1 * c - x2 * s, x2 * c + x1 * s
    mag[..., :half] = (x1 * c).abs() + (x2 * s).abs()
    mag[..., half:rotary_dim] = (x2 * c).abs() + (x1 * s).abs()
    return y, mag


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - expected).abs()
    assert bool((err <= bound).all()), f"{what}: max err/bound {(err / bound).max().item():.3f}"


def check_cache(got: torch.Tensor, expected: torch.Tensor, mag: torch.Tensor, cache_dtype: torch.dtype,
                scale: float, what: str) -> None:
    """got `[..., D]` as stored; expected: the exact float64 values before the cache's rounding."""
    if cache_dtype == FP8:
        z = (expected / scale).clamp(-E4M3_MAX, E4M3_MAX)
        bound = E4M3_UNIT * z.abs() + E4M3_SUBNORMAL_HALF_STEP + 3 * FP32 * (mag / scale + z.abs())
        assert_within(got.float(), z, bound, what)
        saturated = (expected / scale).abs() > E4M3_MAX * (1 + E4M3_UNIT)
        assert torch.equal(got.float()[saturated], torch.sign(expected[saturated]).float() * E4M3_MAX)
    else:
        slack = torch.finfo(cache_dtype).smallest_normal * UNIT_ROUNDOFF[cache_dtype]
        assert_within(got, expected, UNIT_ROUNDOFF[cache_dtype] * expected.abs() + 3 * FP32 * mag + slack, what)


def check(inputs: Inputs, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          input_ulps: int = 0) -> None:
    """`input_ulps`: q and k as the op read them may differ from the inputs' by this many roundings of their dtype
    (normalised by another implementation of the same norm)."""
    c = inputs.case
    q, k, v = inputs.split(torch.device("cpu"))
    q_exp, q_mag = rotate_oracle(q, inputs.positions, inputs.cos, inputs.sin, c.rotary_dim, c.head_size)
    k_exp, k_mag = rotate_oracle(k, inputs.positions, inputs.cos, inputs.sin, c.rotary_dim, c.head_size)
    q_mag, k_mag = (mag * (1 + input_ulps * 2 * UNIT_ROUNDOFF[c.dtype] / (3 * FP32)) for mag in (q_mag, k_mag))

    assert q_out.shape == q.shape and q_out.dtype == c.dtype and q_out.is_contiguous()
    q_got = q_out.view(c.num_tokens, c.num_heads, c.head_size)
    slack = torch.finfo(c.dtype).smallest_normal * UNIT_ROUNDOFF[c.dtype]
    assert_within(q_got, q_exp, UNIT_ROUNDOFF[c.dtype] * q_exp.abs() + 3 * FP32 * q_mag + slack, "q")
    if not input_ulps:
        assert torch.equal(q_got[..., c.rotary_dim:], q.reshape(q_got.shape)[..., c.rotary_dim:])

    valid = inputs.slots >= 0
    slots = inputs.slots[valid]
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    check_cache(k_cache[blocks, offsets], k_exp[valid], k_mag[valid], c.cache_dtype, c.k_scale, "k cache")
    v_rows = v.reshape(c.num_tokens, c.num_kv_heads, c.head_size)[valid]
    if c.cache_dtype == c.dtype:
        assert torch.equal(v_cache[blocks, offsets], v_rows)
    else:
        check_cache(v_cache[blocks, offsets], v_rows.double(), torch.zeros(()), c.cache_dtype, c.v_scale, "v cache")

    untouched = torch.ones(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    untouched[blocks, offsets] = False
    for before, after in zip(inputs.caches, (k_cache, v_cache)):
        assert torch.equal(before.view(torch.uint8)[untouched], after.view(torch.uint8)[untouched])


SHAPES = [  # (tokens, heads, kv heads, head size, rotary dim)
    (1, 4, 2, 64, 64),
    (5, 6, 2, 64, 32),
    (37, 4, 2, 128, 128),
    (37, 6, 2, 64, 32),
    (5, 4, 1, 80, 40),  # head size not a power of two, one KV head
]
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["cache_same", "cache_fp8"])
def test_rope_store_kv_matches_oracle(device: torch.device, shape: tuple, dtype: torch.dtype,
                                      fp8_cache: bool) -> None:
    scales = (0.5, 0.25) if fp8_cache else (1.0, 1.0)
    case = Case(*shape, dtype=dtype, cache_dtype=FP8 if fp8_cache else dtype, k_scale=scales[0], v_scale=scales[1])
    inputs = Inputs(case, seed=sum(shape))
    kernel = inputs.run(rope_store_kv, device)
    reference = inputs.run(rope_store_kv_ref, torch.device("cpu"))
    check(inputs, *kernel)
    check(inputs, *reference)
    if fp8_cache:  # the case does saturate, and the FP8 rounding is the same on both sides
        assert bool((kernel[1].float().abs() == E4M3_MAX).any()) and bool((kernel[2].float().abs() == E4M3_MAX).any())
        assert torch.equal(kernel[2].float(), reference[2].float())  # as values: the interpreter drops -0's sign


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["weight", "unit_offset"])
def test_head_norms_in_the_launch_are_the_norms_then_the_rotation(device: torch.device, shape: tuple,
                                                                   dtype: torch.dtype, unit_offset: bool,
                                                                   launch_features: bool) -> None:
    """Each head of q and k RMS-normalised first (Qwen3's and Gemma 3's q/k norms): the oracle rotates the heads
    as the RMSNorm reference leaves them, so the fused launch must normalise with its numerics (and without the
    launch feature, the norm launches before the rotation give them)."""
    case = Case(*shape, dtype=dtype, cache_dtype=dtype)
    g = torch.Generator().manual_seed(5)
    weights = [(torch.randn(case.head_size, generator=g) * 0.5 + (0.0 if unit_offset else 1.0)).to(dtype)
               for _ in range(2)]

    def norms(on: torch.device) -> HeadNorms:
        return HeadNorms(weights[0].to(on), weights[1].to(on), 1e-6, unit_offset)

    inputs = Inputs(case, seed=sum(shape) + 1)
    kernel = inputs.run(partial(rope_store_kv, head_norms=norms(device)), device)
    reference = inputs.run(partial(rope_store_kv_ref, head_norms=norms(torch.device("cpu"))), torch.device("cpu"))
    normed = Inputs(case, seed=sum(shape) + 1)
    q, k, _ = (x.clone() for x in normed.split(torch.device("cpu")))
    q_n, k_n = head_norms_ref(q, k, norms(torch.device("cpu")), case.head_size)
    assert not torch.equal(q_n, q), "the norms changed nothing: the case would check nothing"
    widths = normed.widths
    normed.qkv[:, :widths[0]] = q_n
    normed.qkv[:, widths[0]:widths[0] + widths[1]] = k_n
    check(normed, *kernel, input_ulps=1)
    check(normed, *reference)


def test_all_padding_rows_write_nothing(device: torch.device) -> None:
    case = Case(4, 4, 2, 64, 64, torch.bfloat16, torch.bfloat16)
    inputs = Inputs(case, seed=11)
    inputs.slots[:] = -1
    q_out, k_cache, v_cache = inputs.run(rope_store_kv, device)
    assert torch.equal(k_cache, inputs.caches[0]) and torch.equal(v_cache, inputs.caches[1])
    check(inputs, q_out, k_cache, v_cache)


def test_empty_batch_and_bad_shapes(device: torch.device) -> None:
    case = Case(3, 4, 2, 64, 32, torch.float32, torch.float32)
    inputs = Inputs(case, seed=12)
    q, k, v = inputs.split(device)
    k_cache, v_cache = (x.clone().to(device) for x in inputs.caches)
    args = (inputs.cos.to(device), inputs.sin.to(device))
    pos, slots = inputs.positions.to(device), inputs.slots.to(device)
    out = rope_store_kv(pos[:0], q[:0], k[:0], v[:0], *args, 32, k_cache, v_cache, slots[:0])
    assert out.shape == (0, 4 * 64)
    assert torch.equal(k_cache.cpu(), inputs.caches[0])
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_store_kv(pos, q, k, v, *args, 64, k_cache, v_cache, slots)  # tables are for 32
    with pytest.raises(ValueError, match="KV heads"):
        rope_store_kv(pos, q, k[:, :64], v[:, :64], *args, 32, k_cache, v_cache, slots)
    ones = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="head_norms: the k weight"):
        rope_store_kv(pos, q, k, v, *args, 32, k_cache, v_cache, slots,
                      head_norms=HeadNorms(ones, ones[:32], 1e-6))


@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3]], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,cache_dtype,fp8_dots", [(torch.float32, torch.float32, False),
                                                        (torch.bfloat16, torch.bfloat16, False),
                                                        (torch.bfloat16, FP8, False), (torch.bfloat16, FP8, True)],
                         ids=["fp32", "bf16", "fp8", "fp8-fp8-dots"])
def test_staged_rows_are_the_rows_written(device: torch.device, shape: tuple, dtype: torch.dtype,
                                          cache_dtype: torch.dtype, fp8_dots: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With `staged`, the launch also writes each token's K and V as the cache now holds them into the staged rows
    (what the prefill attention reads through TMA): exactly `staged_kv_ref` of the caches after the write, zeros for
    the rows written nowhere (-1), and the cache and q as without staging. An FP8 cache stages its e4m3 values as
    fp16 (V in pairs), or as they are for the FP8 dots (launch feature `prefill_fp8_dots`; V transposed by a launch of
    its own, blocks of tokens per program)."""
    from kestrel.kernels import attention, common, rope_kv
    from kestrel.kernels.attention import new_staged_kv, staged_kv_ref, stages_fp8

    monkeypatch.setattr(common, "launch_feature", lambda name, device: name != "prefill_fp8_dots" or fp8_dots)
    monkeypatch.setattr(attention, "FP8_DOTS_MIN_TOKENS", 0)  # on a GPU too: the cases' steps are short
    monkeypatch.setattr(rope_kv, "V_TRANSPOSED_TOKENS", 16)  # the 37 tokens in three blocks, the last one partial

    scales = (0.5, 0.25) if cache_dtype == FP8 else (1.0, 1.0)
    case = Case(*shape, dtype=dtype, cache_dtype=cache_dtype, k_scale=scales[0], v_scale=scales[1])
    inputs = Inputs(case, seed=sum(shape) + 7)
    k_cache = inputs.caches[0].to(device)
    staged = new_staged_kv(case.num_tokens, k_cache)
    assert stages_fp8(k_cache, case.num_tokens) == fp8_dots
    for x in staged:
        x.fill_(float("nan"))
    q_out, k_after, v_after = inputs.run(partial(rope_store_kv, staged=staged), device)
    plain = inputs.run(rope_store_kv, device)
    assert torch.equal(q_out, plain[0])
    assert torch.equal(k_after.view(torch.uint8), plain[1].view(torch.uint8))
    assert torch.equal(v_after.view(torch.uint8), plain[2].view(torch.uint8))
    expected = staged_kv_ref(k_after, v_after, inputs.slots)
    for got, want in zip(staged, expected):
        assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max()
    v_rows = staged[1].cpu().t() if fp8_dots else staged[1].cpu()  # FP8 dots stage V transposed
    assert not staged[0].cpu()[1::3].any() and not v_rows[1::3].any()
    reference = new_staged_kv(case.num_tokens, k_cache.cpu())
    _, k_ref, v_ref = inputs.run(partial(rope_store_kv_ref, staged=reference), torch.device("cpu"))
    for got, want in zip(reference, staged_kv_ref(k_ref, v_ref, inputs.slots)):
        assert torch.equal(got, want)


@triton.jit
def _staged_v_blocks(v_ptr, slot_ptr, v_cache_ptr, staged_v_ptr, v_scale, num_tokens, stride_v, stride_vcb,
                     stride_vct, stride_vch, stride_sv, TAIL: tl.constexpr):
    """One block of `_store_v_transposed_kernel` at Llama-3-8B's KV heads (128 dims, FP8 cache of 16-token blocks,
    64 tokens a program): a full block, or with TAIL the step's last one."""
    rope_kv._store_v_block(v_ptr, slot_ptr, v_cache_ptr, staged_v_ptr, v_scale, tl.program_id(0) * 64,
                           tl.program_id(1), num_tokens, stride_v, stride_vcb, stride_vct, stride_vch, stride_sv,
                           128, 128, 16, True, 64, TAIL, True)


def _staged_v_sm90_reports() -> list[tuple[str, str]]:
    """(PTX, ptxas report) of a full block and of the last block. Run in a process without TRITON_INTERPRET."""
    pointers = {"v_ptr": "*bf16", "slot_ptr": "*i64", "v_cache_ptr": "*fp8e4nv", "staged_v_ptr": "*fp8e4nv"}
    ints = ["num_tokens", "stride_v", "stride_vcb", "stride_vct", "stride_vch", "stride_sv"]
    return [sm90.compile_sm90(_staged_v_blocks, pointers, ints, {"TAIL": tail}, 4, floats=("v_scale",))
            for tail in (False, True)]


def test_transposed_v_full_blocks_store_in_16_byte_vectors():
    """A mask along the tokens against the launch's unspecialized token count made Triton store the transposed V
    byte by byte (half the launch's speed over an 8k prompt on an H100): only the last block may."""
    (full, _), (tail, _) = sm90.reports("test_rope_kv_kernel", "_staged_v_sm90_reports()")
    assert "st.global.v4.b32" in full and "st.global.b8" not in full
    assert "st.global.b8" in tail  # the last block's tokens are masked one by one
