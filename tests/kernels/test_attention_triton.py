"""Triton paged attention and KV write against a float64 dense oracle (interpreted on CPU, compiled on CUDA).

tests/kernels/conftest.py sets TRITON_INTERPRET=1 when there is no GPU, before the kernel modules are
imported (or reloads them), so these tests run the real kernels everywhere. Shapes stay small: the
interpreter executes every program in Python. Small tile configs are forced in most cases so a few dozen
keys already span several key tiles (unmasked and masked loops, several query tiles per sequence).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kestrel.kernels.attention import AttnConfig, paged_attention, paged_attention_ref, staged_kv_ref
from kestrel.kernels.common import round_e4m3
from kestrel.kernels.store_kv import store_kv, store_kv_ref

BLOCK_SIZE = 16
SMALL_DECODE = AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
SMALL_PREFILL = AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
FP8_DOTS_PREFILL = AttnConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)  # FP8 dots take 32-key tiles
# Bounds on the relative (norm-wise) error of the prefill launch's FP8 dots on these cases (measured 1.2-1.3% and
# 1.9-2.1%): P's e4m3 rounding alone, and with the queries' too
FP8_P_ROUNDING = 2e-2
FP8_DOTS_ROUNDING = 3e-2

# (context length after the step, query tokens this step): a full prefill, prefill chunks over cached
# context, decodes (short and several blocks long), a 2-token query (speculative-style, decode launch),
# a one-token prompt and a sequence with nothing scheduled.
MIXED = [(37, 37), (58, 21), (45, 1), (70, 1), (3, 1), (29, 2), (1, 1), (24, 0), (40, 9)]


def e4m3_rows(q: torch.Tensor) -> torch.Tensor:
    """Each `[..., D]` row of q scaled by its absolute max to e4m3's range, rounded to e4m3 and scaled back (float64):
    the queries of the prefill launch's FP8 dots."""
    x = q.float()
    row_scale = x.abs().amax(-1, keepdim=True) / 448.0
    row_scale = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
    return (x / row_scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * row_scale.double()


def dense_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 window: int | None, soft_cap: float | None = None, fp8_own_keys: bool = False) -> torch.Tensor:
    """Causal attention in float64 for one sequence: q `[Lq, H, D]` are the last Lq of k/v's `[L, H_kv, D]`;
    with a soft cap, scores become `cap * tanh(scores / cap)` (Gemma 2) before the mask. `fp8_own_keys`: the
    scores of the sequence's own keys (the last Lq) take q rounded to e4m3 per row (`e4m3_rows`)."""
    query_len, num_heads, _ = q.shape
    context = k.shape[0]
    group = num_heads // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if fp8_own_keys:
        own = slice(context - query_len, context)
        scores[..., own] = torch.einsum("qhd,khd->hqk", e4m3_rows(q), kk[own]) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(context - query_len, context).unsqueeze(1)
    k_pos = torch.arange(context).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def read_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Cache rows at `slots` as float64 on the CPU (gathered through a byte view: FP8 included)."""
    rows = cache.view(torch.uint8).view(-1, *cache.shape[2:-1], cache.shape[-1] * cache.element_size())
    return rows[slots.to(cache.device)].view(cache.dtype).cpu().double()


class Case:
    """A flat batch over a paged cache: per-sequence K/V scattered over shuffled blocks, with optional
    prefix sharing (the second sequence reuses the first one's leading full blocks, as the prefix cache
    does), padded block tables (padding 0 is a live block of another sequence) and unwritten blocks full
    of NaN so any stray read shows up."""

    def __init__(self, seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_size: int,
                 device: torch.device, dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0, share_prefix_blocks: int = 0, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        cache_dtype = cache_dtype or dtype
        blocks_needed = sum(-(-ctx // BLOCK_SIZE) for ctx, _ in seqs)
        num_blocks = blocks_needed + 5
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
        fill = float("nan") if cache_dtype != torch.float8_e4m3fn else 0.0
        self.k_cache = torch.full(shape, fill, dtype=dtype).to(cache_dtype).to(device)
        self.v_cache = torch.full(shape, fill, dtype=dtype).to(cache_dtype).to(device)
        if cache_dtype == torch.float8_e4m3fn:  # e4m3fn NaN is 0x7f
            self.k_cache.view(torch.uint8).fill_(0x7F)
            self.v_cache.view(torch.uint8).fill_(0x7F)
        # CPU tensors on a CUDA machine (a case for the CPU paths) are written by the reference: Triton compiles
        # for the GPU there, and interprets only where no GPU is present
        write = store_kv_ref if device.type == "cpu" and torch.cuda.is_available() else store_kv
        free = torch.randperm(num_blocks, generator=g).tolist()
        max_blocks = max(-(-ctx // BLOCK_SIZE) for ctx, _ in seqs) + 2
        self.block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        self.keys, self.values = [], []
        query_slots: list[torch.Tensor] = []  # the slot of each query row: where the step wrote its K/V
        for s, (ctx, query_len) in enumerate(seqs):
            k = torch.randn(ctx, num_kv_heads, head_size, generator=g)
            v = torch.randn(ctx, num_kv_heads, head_size, generator=g)
            n_blocks = -(-ctx // BLOCK_SIZE)
            shared = min(share_prefix_blocks, n_blocks - 1, len(self.keys[0]) // BLOCK_SIZE) if s == 1 else 0
            if shared:
                k[: shared * BLOCK_SIZE] = self.keys[0][: shared * BLOCK_SIZE]
                v[: shared * BLOCK_SIZE] = self.values[0][: shared * BLOCK_SIZE]
            blocks = self.block_tables[0, :shared].tolist() + [free.pop() for _ in range(n_blocks - shared)]
            self.block_tables[s, :n_blocks] = torch.tensor(blocks, dtype=torch.int32)
            slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx)])
            write(k.to(dtype).to(device), v.to(dtype).to(device), self.k_cache, self.v_cache, slots.to(device),
                  k_scale, v_scale)
            # what the cache holds, dequantized: the oracle attends over exactly these values
            k_stored = read_slots(self.k_cache, slots) * (k_scale if cache_dtype == torch.float8_e4m3fn else 1.0)
            v_stored = read_slots(self.v_cache, slots) * (v_scale if cache_dtype == torch.float8_e4m3fn else 1.0)
            self.keys.append(k_stored)
            self.values.append(v_stored)
            query_slots.append(slots[ctx - query_len:])
        self.query_slots = torch.cat(query_slots).to(device)
        query_lens = [n for _, n in seqs]
        self.q = torch.randn(sum(query_lens), num_heads, head_size, generator=g).to(dtype).to(device)
        self.query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.seq_lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32)
        self.seqs = seqs
        self.scale = head_size**-0.5
        self.block_tables = self.block_tables.to(device)
        self.query_start_loc = self.query_start_loc.to(device)
        self.seq_lens = self.seq_lens.to(device)

    def staged_then_poisoned(self, dec_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's own K/V staged (`staged_kv_ref`), then the cache slots of the rows the prefill launch takes
        (queries longer than `dec_q`) poisoned with NaN (FP8: its NaN byte): a launch that still reads them shows."""
        staged = staged_kv_ref(self.k_cache, self.v_cache, self.query_slots)
        starts = self.query_start_loc.tolist()
        prefilled = torch.cat([self.query_slots[starts[s]:starts[s + 1]] for s, (_, n) in enumerate(self.seqs)
                               if n > dec_q]).long()
        for cache in (self.k_cache, self.v_cache):
            rows = cache.view(-1, *cache.shape[2:])
            if cache.dtype == torch.float8_e4m3fn:
                rows.view(torch.uint8)[prefilled] = 0x7F
            else:
                rows[prefilled] = float("nan")
        return staged

    def run(self, fn=paged_attention, **kwargs) -> torch.Tensor:
        return fn(self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables,
                  self.scale, **kwargs)

    def expected(self, window: int | None = None, soft_cap: float | None = None, fp8_dots_from: int | None = None
                 ) -> torch.Tensor:
        """The float64 oracle; `fp8_dots_from`: sequences of more query tokens than this (the prefill launch's)
        score their own keys with e4m3 queries, as FP8_DOTS does."""
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        starts = self.query_start_loc.tolist()
        for s, (_, query_len) in enumerate(self.seqs):
            rows = slice(starts[s], starts[s + 1])
            if rows.stop > rows.start:
                fp8 = fp8_dots_from is not None and query_len > fp8_dots_from
                out[rows] = dense_oracle(self.q[rows].cpu(), self.keys[s], self.values[s], self.scale, window,
                                         soft_cap, fp8_own_keys=fp8)
        return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.cpu().double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (16, 2)], ids=["gqa1", "gqa4", "gqa8"])
def test_mixed_batch_gqa(device: torch.device, num_heads: int, num_kv_heads: int) -> None:
    case = Case(MIXED, num_heads, num_kv_heads, 64, device, share_prefix_blocks=2)
    out = case.run(decode_cfg=SMALL_DECODE, prefill_cfg=SMALL_PREFILL, num_splits=1)
    assert rel_err(out, case.expected()) < 1e-5


def test_prefix_shared_blocks_are_shared(device: torch.device) -> None:
    """Guards the prefix-sharing setup: the two sequences really point at the same physical blocks."""
    case = Case(MIXED, 8, 2, 64, device, share_prefix_blocks=2)
    assert torch.equal(case.block_tables[0, :2], case.block_tables[1, :2])


def test_default_configs_head128(device: torch.device) -> None:
    """The tuned tiles (large prefill tile, default split choice) on head size 128."""
    seqs = [(150, 150), (90, 40), (200, 1), (33, 1)]
    case = Case(seqs, 8, 2, 128, device, seed=1)
    assert rel_err(case.run(), case.expected()) < 1e-5
    hinted = case.run(max_query_len=150, max_seq_len=200)
    assert rel_err(hinted, case.expected()) < 1e-5


def test_single_prefill_with_hint_skips_decode_launch(device: torch.device) -> None:
    """One prefilling sequence: with max_query_len the decode launch is skipped. All tokens in one sequence among
    idle ones: max_query_len is only a bound there, so both launches run (the idle rows' programs exit)."""
    alone = Case([(60, 30)], 8, 2, 64, device, seed=10)
    assert rel_err(alone.run(max_query_len=30, max_seq_len=60, prefill_cfg=SMALL_PREFILL), alone.expected()) < 1e-5
    case = Case([(40, 0), (60, 30), (10, 0)], 8, 2, 64, device, seed=10)
    out = case.run(max_query_len=30, max_seq_len=60, prefill_cfg=SMALL_PREFILL)
    assert rel_err(out, case.expected()) < 1e-5


@pytest.mark.parametrize("window", [1, 7, 20])
def test_sliding_window(device: torch.device, window: int) -> None:
    case = Case(MIXED, 8, 2, 64, device, seed=2)
    out = case.run(sliding_window=window, decode_cfg=SMALL_DECODE, prefill_cfg=SMALL_PREFILL, num_splits=2)
    assert rel_err(out, case.expected(window)) < 1e-5


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv(device: torch.device, num_splits: int, launch_features: bool) -> None:
    """Flash-decoding partials + merge, including splits left empty by short contexts and a 2-token query."""
    seqs = [(130, 1), (77, 1), (9, 1), (64, 2), (1, 1)]
    case = Case(seqs, 16, 2, 64, device, seed=3)
    out = case.run(decode_cfg=SMALL_DECODE, num_splits=num_splits)
    assert rel_err(out, case.expected()) < 1e-5


def test_chosen_splits_fill_per_sequence_and_merge_by_last_arrival(device: torch.device,
                                                                   launch_features: bool) -> None:
    """Splits chosen by the launcher are a ceiling: each sequence uses what its keys fill (64 keys a split:
    5, 2, 1 and 3 of the launch's 8 here), the last split to finish merges, and the counters are left zeroed for
    the next launch (a second run gives the same bytes). Without the feature every split runs and the merge launch
    combines them."""
    from kestrel.kernels import common

    seqs = [(300, 1), (70, 1), (9, 1), (129, 2)]
    case = Case(seqs, 8, 2, 64, device, seed=13)
    out = case.run(decode_cfg=SMALL_DECODE)
    assert rel_err(out, case.expected()) < 1e-5
    assert not common.arrival_counters(case.q.device).any()
    assert torch.equal(case.run(decode_cfg=SMALL_DECODE), out)


def test_split_kv_mixed_batch(device: torch.device, launch_features: bool) -> None:
    """Split decode launch next to the prefill launch in one batch: each writes only its own rows."""
    case = Case(MIXED, 8, 2, 64, device, seed=4)
    out = case.run(decode_cfg=SMALL_DECODE, prefill_cfg=SMALL_PREFILL, num_splits=3)
    assert rel_err(out, case.expected()) < 1e-5


@pytest.mark.parametrize("head_size", [64, 128], ids=["pairs-joined", "pairs-apart"])
def test_fp8_kv(device: torch.device, head_size: int) -> None:
    """FP8 e4m3 cache written by the Triton store_kv with per-tensor scales, dequantized in registers. V is read in
    words of two values; the prefill launch runs P @ V over them as one dot for heads under 128, as two (even and
    odd dims) for heads of 128."""
    k_scale, v_scale = 0.011, 0.0073
    case = Case(MIXED, 8, 2, head_size, device, cache_dtype=torch.float8_e4m3fn, k_scale=k_scale, v_scale=v_scale,
                share_prefix_blocks=1, seed=5)
    out = case.run(k_scale=k_scale, v_scale=v_scale, decode_cfg=SMALL_DECODE, prefill_cfg=SMALL_PREFILL,
                   num_splits=2)
    assert rel_err(out, case.expected()) < 1e-5


STAGED_CACHES = [(torch.float32, False, False), (torch.bfloat16, False, False), (torch.float8_e4m3fn, False, False),
                 (torch.float8_e4m3fn, True, False), (torch.float8_e4m3fn, True, True)]


@pytest.mark.parametrize("cache_dtype,fp8_dots,scores_in_exp", STAGED_CACHES,
                         ids=["fp32", "bf16", "fp8", "fp8-fp8-dots", "fp8-fp8-dots-scores-in-exp"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (7, None), (None, 5.0)], ids=["causal", "window", "cap"])
def test_prefill_reads_the_steps_own_keys_from_the_staged_rows(device: torch.device, cache_dtype: torch.dtype,
                                                               fp8_dots: bool, scores_in_exp: bool,
                                                               window: int | None, soft_cap: float | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With `new_kv` the prefill launch reads each sequence's own keys from the staged rows and only its earlier
    ones from the cache: once staged, the cache slots of the prefilled rows are filled with NaN (FP8: its NaN
    byte), which the launch must not read, and the output still matches the oracle of what the cache held. Decode
    rows keep reading the cache. Tiles of 16 keys end inside chunks whose context is not a multiple of 16.

    With FP8 dots (launch feature `prefill_fp8_dots`) the own keys' scores take e4m3 queries and P enters P @ V as
    e4m3: against the oracle with those queries only P's rounding is left (about 1.2% here), against the exact
    oracle the queries' rounding adds to it (about 2% in all). Either with the scores' scale multiplied in or taken
    in the exponent's FMA (launch feature `fp8_dots_scores_in_exp`; the soft cap keeps the multiply)."""
    from kestrel.kernels import attention, common

    # a GPU's table may not have them yet
    features = {"prefill_fp8_dots": fp8_dots, "fp8_dots_scores_in_exp": scores_in_exp}
    monkeypatch.setattr(common, "launch_feature", lambda name, device: features.get(name, True))
    monkeypatch.setattr(attention, "FP8_DOTS_MIN_TOKENS", 0)  # on a GPU too: the cases' steps are short
    k_scale, v_scale = (0.011, 0.0073) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    # 16-bit activations on a GPU (its float32 ones keep the gathered path); float32 in the interpreter but for BF16
    gpu_fp8 = device.type == "cuda" and cache_dtype == torch.float8_e4m3fn
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 or gpu_fp8 else torch.float32
    case = Case(MIXED, 8, 2, 32, device, dtype=dtype, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale,
                seed=21)
    if not attention.reads_staged_kv(case.q, case.k_cache, case.v_cache):
        pytest.skip("no TMA on this GPU (or float32 activations on a GPU): the prefill launch gathers every key")
    assert attention.stages_fp8(case.k_cache, case.q.shape[0]) == fp8_dots
    if fp8_dots:  # an e4m3 wgmma reduces over 32 keys at least
        with pytest.raises(ValueError, match="block_n=16: the FP8 dots"):
            case.run(new_kv=staged_kv_ref(case.k_cache, case.v_cache, case.query_slots), prefill_cfg=SMALL_PREFILL)
    dec_q = SMALL_DECODE.block_m // 4
    expected = case.expected(window, soft_cap)
    staged = case.staged_then_poisoned(dec_q)
    out = case.run(new_kv=staged, k_scale=k_scale, v_scale=v_scale, sliding_window=window, logit_soft_cap=soft_cap,
                   decode_cfg=SMALL_DECODE, prefill_cfg=FP8_DOTS_PREFILL if fp8_dots else SMALL_PREFILL,
                   num_splits=1)
    if fp8_dots:
        assert rel_err(out, case.expected(window, soft_cap, fp8_dots_from=dec_q)) < FP8_P_ROUNDING
        assert rel_err(out, expected) < FP8_DOTS_ROUNDING
    else:
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert rel_err(out, expected) < tolerance


@pytest.mark.parametrize("fp8_dots", [False, True], ids=["fp16-dots", "fp8-dots"])
def test_staged_prefill_over_fp8_heads_of_128_keeps_the_pairs_apart(device: torch.device, fp8_dots: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads of 128 keep V's paired halves apart in the prefill launch (two 64-wide dots), staged halves included;
    with the FP8 dots the cached keys' two accumulators join before the staged keys' FP8 dot. (The heads of 32
    above join the halves into one dot.) Fresh prompts, a chunk over context, decodes."""
    from kestrel.kernels import attention, common

    monkeypatch.setattr(common, "launch_feature", lambda name, device: name != "prefill_fp8_dots" or fp8_dots)
    monkeypatch.setattr(attention, "FP8_DOTS_MIN_TOKENS", 0)  # on a GPU too: the case's step is short
    k_scale, v_scale = 0.011, 0.0073
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    case = Case([(37, 37), (58, 21), (45, 1), (40, 9)], 4, 2, 128, device, dtype=dtype,
                cache_dtype=torch.float8_e4m3fn, k_scale=k_scale, v_scale=v_scale, seed=24)
    if not attention.reads_staged_kv(case.q, case.k_cache, case.v_cache):
        pytest.skip("no TMA on this GPU: the prefill launch gathers every key")
    dec_q = SMALL_DECODE.block_m // 2
    expected = case.expected()
    staged = case.staged_then_poisoned(dec_q)
    out = case.run(new_kv=staged, k_scale=k_scale, v_scale=v_scale, decode_cfg=SMALL_DECODE,
                   prefill_cfg=FP8_DOTS_PREFILL if fp8_dots else SMALL_PREFILL, num_splits=1)
    if fp8_dots:
        assert rel_err(out, case.expected(fp8_dots_from=dec_q)) < FP8_P_ROUNDING
    else:
        assert rel_err(out, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@triton.jit
def _round_all(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, round_e4m3(tl.load(x_ptr + offs)))


def test_interpreter_rounds_to_e4m3_as_torch_does(device: torch.device) -> None:
    """`common.round_e4m3`, the interpreter's stand-in for the GPU's e4m3 conversion (FP8 dots, FP8 caches): the value
    of torch's e4m3 rounding for normals, subnormals, zeros and every tie between two e4m3 values."""
    g = torch.Generator().manual_seed(0)
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite e4m3 >= 0
    ties = (values[:-1] + values[1:]) / 2
    spread = torch.cat([torch.randn(512, generator=g) * s for s in (1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0)])
    x = torch.cat([values, -values, ties, -ties, spread.clamp(-448, 448)])
    x = torch.nn.functional.pad(x, (0, triton.next_power_of_2(len(x)) - len(x)))
    out = torch.empty_like(x, device=device)
    _round_all[(1,)](x.to(device), out, N=len(x))
    assert torch.equal(out.cpu(), x.to(torch.float8_e4m3fn).float())


def test_staged_rows_hold_what_the_cache_holds(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """`staged_kv_ref`: row t is slot t's K and V in the staged dtype (an FP8 cache's values exactly, as fp16, V's
    even dims first; with FP8 dots the cache's own e4m3 bytes, V transposed), zeros for a row written nowhere."""
    from kestrel.kernels import attention, common

    monkeypatch.setattr(common, "launch_feature", lambda name, device: name != "prefill_fp8_dots")
    cache = torch.randn(3, 4, 2, 8).to(torch.float8_e4m3fn).to(device)
    values = torch.randn(3, 4, 2, 8).to(torch.float8_e4m3fn).to(device)
    slots = torch.tensor([5, -1, 0], device=device)
    k, v = staged_kv_ref(cache, values, slots)
    assert k.dtype == v.dtype == torch.float16 and k.shape == v.shape == (3, 16)
    assert torch.equal(k[0].view(2, 8), cache.view(-1, 2, 8)[5].to(torch.float16))
    assert torch.equal(v[2].view(2, 8), torch.cat((values.view(-1, 2, 8)[0, :, 0::2],
                                                   values.view(-1, 2, 8)[0, :, 1::2]), -1).to(torch.float16))
    assert not k[1].any() and not v[1].any()
    empty = staged_kv_ref(cache, values, slots[:0])
    assert empty[0].shape == empty[1].shape == (0, 16)
    monkeypatch.setattr(common, "launch_feature", lambda name, device: True)
    monkeypatch.setattr(attention, "FP8_DOTS_MIN_TOKENS", 0)  # on a GPU too: these steps are 3 tokens
    assert staged_kv_ref(cache, values, slots)[0].dtype == torch.float16  # heads of 8: too narrow for FP8 dots
    cache = torch.randn(3, 4, 2, 32).to(torch.float8_e4m3fn).to(device)
    values = torch.randn(3, 4, 2, 32).to(torch.float8_e4m3fn).to(device)
    k, v = staged_kv_ref(cache, values, slots)
    assert k.dtype == v.dtype == torch.float8_e4m3fn and k.shape == (3, 64) and v.shape == (64, 3)
    assert v.stride() == (16, 1)  # V transposed, its rows padded to 16 bytes
    assert torch.equal(k.view(torch.uint8)[0], cache.view(torch.uint8).view(-1, 64)[5])
    assert torch.equal(v.view(torch.uint8)[:, 2], values.view(torch.uint8).view(-1, 64)[0])
    assert not k.view(torch.uint8)[1].any() and not v.view(torch.uint8)[:, 1].any()


def test_head128_bf16(device: torch.device) -> None:
    seqs = [(50, 50), (40, 1), (66, 3)]
    case = Case(seqs, 8, 1, 128, device, dtype=torch.bfloat16, seed=6)
    out = case.run(decode_cfg=SMALL_DECODE, prefill_cfg=SMALL_PREFILL, num_splits=2)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, case.expected()) < 1e-2


def test_head_size_not_power_of_two(device: torch.device) -> None:
    seqs = [(20, 20), (35, 1)]
    case = Case(seqs, 4, 2, 80, device, seed=7)
    out = case.run(decode_cfg=SMALL_DECODE, prefill_cfg=SMALL_PREFILL, num_splits=2)
    assert rel_err(out, case.expected()) < 1e-5


def test_writes_only_into_out(device: torch.device) -> None:
    case = Case([(20, 20), (35, 1)], 4, 2, 64, device, seed=8)
    out = torch.full_like(case.q, float("nan"))
    result = case.run(out=out, decode_cfg=SMALL_DECODE, prefill_cfg=SMALL_PREFILL, num_splits=2)
    assert result is out
    assert rel_err(out, case.expected()) < 1e-5


# ------------------------------------------------------------------------------- soft cap, scale, window

# A small mixed batch: a prefill longer than one query tile, a decode, a 3-token query, a chunk over cached
# context and an idle sequence.
SMALL_MIXED = [(20, 20), (33, 1), (18, 3), (40, 9), (5, 0)]


@pytest.mark.parametrize("scale,soft_cap,cache_dtype,num_splits", [
    (1.0, 5.0, torch.float32, 2), (1 / 16, 0.5, torch.float32, 1), (1.0, 5.0, torch.float8_e4m3fn, 2),
], ids=["d32-split", "q256", "fp8-split"])
def test_logit_soft_cap(device: torch.device, scale: float, soft_cap: float, cache_dtype: torch.dtype,
                        num_splits: int) -> None:
    """Gemma 2's cap on the scaled scores in the prefill and decode launches (split or not), with a scale that is
    not 1/sqrt(head_size) (Gemma's query_pre_attn_scalar^-1/2); the scores reach several times the cap, so the
    cap changes the output. FP8: k_scale folds into the capped multiplier too. The reference agrees."""
    k_scale, v_scale = (0.011, 0.0073) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    case = Case(SMALL_MIXED, 4, 2, 32, device, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale, seed=20)
    case.scale = scale
    capped = case.expected(soft_cap=soft_cap)
    assert rel_err(capped, case.expected()) > 0.05
    out = case.run(logit_soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, decode_cfg=SMALL_DECODE,
                   prefill_cfg=SMALL_PREFILL, num_splits=num_splits)
    assert rel_err(out, capped) < 1e-5
    ref = case.run(paged_attention_ref, k_scale=k_scale, v_scale=v_scale, logit_soft_cap=soft_cap)
    assert rel_err(ref, capped) < 1e-5


def test_window_and_soft_cap_are_per_call(device: torch.device) -> None:
    """The same caches and queries under changing window and cap, in turn: nothing sticks between calls."""
    case = Case(SMALL_MIXED, 4, 2, 32, device, seed=21)
    case.scale = 0.5
    for window, soft_cap in ((6, 3.0), (None, None), (13, None)):
        out = case.run(sliding_window=window, logit_soft_cap=soft_cap, decode_cfg=SMALL_DECODE,
                       prefill_cfg=SMALL_PREFILL, num_splits=1)
        assert rel_err(out, case.expected(window, soft_cap)) < 1e-5


def test_soft_cap_must_be_positive(device: torch.device) -> None:
    case = Case([(4, 4)], 2, 2, 16, device, seed=22)
    for fn in (paged_attention, paged_attention_ref):
        with pytest.raises(ValueError, match="positive"):
            case.run(fn, logit_soft_cap=0.0)


# ------------------------------------------------------------------------------------------------ store_kv


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_store_kv_matches_reference(device: torch.device, cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(9)
    num_tokens, num_kv_heads, head_size, num_blocks = 13, 3, 64, 4
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 2
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 2
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 3.0])  # saturates at +-448 * scale in FP8
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:num_tokens]
    slots[[2, 7]] = -1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    caches = [torch.randn(shape, generator=g).to(cache_dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    if cache_dtype != torch.float8_e4m3fn:  # K/V arrive in the cache's dtype: a plain copy
        key, value = key.to(cache_dtype), value.to(cache_dtype)
    store_kv_ref(key, value, expected[0], expected[1], slots, 0.5, 0.25)
    got = [c.clone().to(device) for c in caches]
    store_kv(key.to(device), value.to(device), got[0], got[1], slots.to(device), 0.5, 0.25)
    for e, o in zip(expected, got):
        o = o.cpu()
        if cache_dtype != torch.float8_e4m3fn or device.type == "cuda":
            assert torch.equal(e.view(torch.uint8), o.view(torch.uint8))
            continue
        # Triton's interpreter rounds fp32 -> fp8 in software that drops a mantissa carry (a value just
        # under 2.0 becomes 1.0) and rounds some subnormals down; the GPU's cvt instruction rounds right.
        # Off the GPU, accept only such round-downs: same sign, magnitude in [ref / 2, ref).
        same = e.view(torch.uint8) == o.view(torch.uint8)
        assert same.float().mean() > 0.9
        ef, of = e.float()[~same], o.float()[~same]
        assert bool(((of * ef > 0) & (of.abs() < ef.abs()) & (of.abs() >= ef.abs() / 2)).all())


# ------------------------------------------------------------------------------------- FP8 KV scales


def test_fp8_kv_scales_default_checkpoint_and_calibrated(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """No scales in the checkpoint: 1.0 and a warning; scales in the checkpoint are read per layer; the
    calibrated option sets amax / 448 per layer and generation still runs on the FP8 cache."""
    from safetensors.torch import save_file

    from kestrel.config import EngineConfig
    from kestrel.loader.model_init import write_tiny_checkpoint
    from kestrel.worker.kv_cache import checkpoint_kv_scales
    from kestrel.worker.model_runner import ModelRunner

    write_tiny_checkpoint(str(tmp_path), arch="llama", seed=3)
    config = EngineConfig.from_kwargs(str(tmp_path), dtype="float32", kv_cache_dtype="fp8", max_model_len=64,
                                      device="cpu")
    with caplog.at_level("WARNING"):
        runner = ModelRunner(config)
    num_layers = len(runner.model.attention_layers())
    assert runner.kv_scales == [(1.0, 1.0)] * num_layers
    assert any("no KV cache scales" in r.getMessage() for r in caplog.records)

    scales = runner.calibrate_kv_scales(num_tokens=40)
    assert len(scales) == num_layers and all(0 < k < 1 and 0 < v < 1 for k, v in scales)
    assert [(layer.k_scale, layer.v_scale) for layer in runner.model.attention_layers()] == scales

    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.25])},
              str(tmp_path / "kv_scales.safetensors"))
    read = checkpoint_kv_scales(str(tmp_path), [layer.prefix for layer in runner.model.attention_layers()])
    assert read is not None and read[0] == (0.5, 1.0) and read[1] == (1.0, 0.25)


def test_calculate_kv_scales_measures_them_at_start_up(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """calculate_kv_scales: the runner binds the scales a calibration measures, inside its start-up (the same
    scales a calibration after it measures), without the no-scales warning; it needs an FP8 cache."""
    from kestrel.config import ConfigError, EngineConfig
    from kestrel.loader.model_init import write_tiny_checkpoint
    from kestrel.worker.model_runner import ModelRunner

    write_tiny_checkpoint(str(tmp_path), arch="llama", seed=4)
    kwargs = {"dtype": "float32", "kv_cache_dtype": "fp8", "max_model_len": 64, "device": "cpu"}
    with caplog.at_level("WARNING"):
        runner = ModelRunner(EngineConfig.from_kwargs(str(tmp_path), calculate_kv_scales=True, **kwargs))
    assert not any("no KV cache scales" in r.getMessage() for r in caplog.records)
    measured = runner.kv_scales
    assert all(0 < k < 1 and 0 < v < 1 for k, v in measured)
    assert [(layer.k_scale, layer.v_scale) for layer in runner.model.attention_layers()] == measured
    after = ModelRunner(EngineConfig.from_kwargs(str(tmp_path), **kwargs))
    assert after.kv_scales != measured
    flat = [s for pair in measured for s in pair]
    assert [s for pair in after.calibrate_kv_scales() for s in pair] == pytest.approx(flat, rel=1e-6)
    with pytest.raises(ConfigError, match="calculate_kv_scales.*kv_cache_dtype='fp8'"):
        EngineConfig.from_kwargs(str(tmp_path), calculate_kv_scales=True, dtype="float32", device="cpu")


@pytest.mark.parametrize("arch,extra", [
    ("gemma3", {}),  # sliding-window and global layers in two KV-cache groups
    ("llama", {"streaming_window": {"window": 64, "sink_tokens": 4}, "enforce_eager": True}),
    ("llama", {"sparse_decode": {"method": "quest", "token_budget": 64}}),  # key bounds written beside the keys
], ids=["gemma3", "streaming", "quest"])
def test_scales_measured_at_start_up_serve_as_those_calibrated_after_it(tmp_path, arch, extra) -> None:
    """Under each cache layout the calibration prefill runs inside the start-up, and the engine generates what an
    engine calibrated after its start-up (its cache written by the calibration then) does."""
    from kestrel import LLM, SamplingParams
    from kestrel.loader.model_init import write_tiny_checkpoint

    write_tiny_checkpoint(str(tmp_path), arch=arch, seed=5)
    kwargs = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "kv_cache_dtype": "fp8", **extra}
    at_start = LLM(str(tmp_path), calculate_kv_scales=True, **kwargs)
    after = LLM(str(tmp_path), **kwargs)
    after.runner.calibrate_kv_scales()
    assert at_start.runner.kv_scales == after.runner.kv_scales != [(1.0, 1.0)] * len(after.runner.kv_scales)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (35, 60)]  # a stream takes 68 at most
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
              for llm in (at_start, after)]
    assert tokens[0] == tokens[1]


def test_calibration_captures_the_graphs_again_once(tmp_path, monkeypatch) -> None:
    """A calibration after start-up runs its passes eagerly and captures the graphs again once, after the last."""
    from kestrel.config import EngineConfig
    from kestrel.loader.model_init import write_tiny_checkpoint
    from kestrel.worker.model_runner import ModelRunner

    write_tiny_checkpoint(str(tmp_path), arch="llama", seed=4)
    runner = ModelRunner(EngineConfig.from_kwargs(str(tmp_path), dtype="float32", kv_cache_dtype="fp8",
                                                  max_model_len=64, device="cpu"))
    captured = []
    monkeypatch.setattr(runner, "_capture_graphs", lambda: captured.append(list(runner.kv_scales)))
    runner.graph_runner = object()  # as if graphs were captured at start-up (a CPU runner captures none)
    scales = runner.calibrate_kv_scales(passes=3)
    assert captured == [scales]


def test_fp8_kv_decode_with_a_wide_group_joins_the_pairs(device: torch.device) -> None:
    """64 query heads on one KV head fill a 64-row decode tile (a wgmma tile on Hopper): its P @ V runs as one dot
    over V's paired halves joined back into head order, as the prefill launch's does for heads under 128."""
    k_scale, v_scale = 0.011, 0.0073
    case = Case([(40, 1), (70, 1), (5, 1)], 64, 1, 64, device, cache_dtype=torch.float8_e4m3fn, k_scale=k_scale,
                v_scale=v_scale, seed=23)
    out = case.run(k_scale=k_scale, v_scale=v_scale, decode_cfg=AttnConfig(64, 16, 4, 2), num_splits=2)
    assert rel_err(out, case.expected()) < 1e-5
