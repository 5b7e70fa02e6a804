"""`kestrel bench attention`: paged attention against SDPA on contiguous KV (BENCHMARKS.md "attention").

Shapes: 32 query heads / 8 KV heads of 128, block size 16, block tables scattered at random over one
pool. Decode: batch {1, 16, 64, 256} x context {512, 2k, 4k, 8k, 32k}, BF16 and FP8 (e4m3) KV, every
split count of the flash-decoding path; prefill: one causal sequence of 1k-16k tokens; chunked prefill
(a chunk over cached context); a mixed batch (chunk + decodes). Anchors, measured in the same run:
`scaled_dot_product_attention` over contiguous KV (decode and causal prefill; lower-right causal mask for
chunks) and a device-to-device copy for the bandwidth ceiling.

Method: every variant is checked against a float32 reference (decode: sampled sequences; prefill:
sampled query rows) before it is timed; timing captures a CUDA graph holding one call per rotated input
set (enough sets to overflow the L2) and reports the median over `--runs` replays. Kernels are compiled
ahead in worker processes (Triton's disk cache), which also run a correctness suite over head sizes,
GQA ratios, sliding window, FP8, forced splits and CUDA-graph replay with changed lengths.
`--smoke` runs tiny shapes on the CPU to check this script (set TRITON_INTERPRET=1 for that).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

from kestrel.bench import register_suite
from kestrel.bench.timing import time_calls, time_eager
from kestrel.kernels import attention as attn
from kestrel.kernels.attention import AttnConfig
from kestrel.kernels.store_kv import store_kv, store_kv_ref

ROTATE_BYTES = 3 * 60 * 2**20  # three times the H200's L2
MAX_ROTATIONS = 64
FP8_SCALE = 1.0 / 32  # pool values are ~N(0, 1): stored = value * 32 stays well inside e4m3's +-448
ERR_LIMIT = 2e-2  # bf16 output rounding is ~4e-3 relative
FALLBACK = {"copy_TBps": 4.26, "bf16_TFLOPs": 760.0}  # BENCHMARKS.md, when the run cannot measure


@dataclass(frozen=True)
class Suite:
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    decode_batches: tuple[int, ...]
    decode_ctx: tuple[int, ...]
    splits: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]  # (query chunk, context after the step)
    mixed: tuple[int, int, int, int]  # (chunk, chunk context, decodes, decode context)
    decode_sweep_points: tuple[tuple[int, int, int], ...]  # (batch, ctx, splits)
    prefill_sweep_lens: tuple[int, ...]
    decode_candidates: dict[str, tuple[AttnConfig, ...]] = field(default_factory=dict)
    prefill_candidates: tuple[AttnConfig, ...] = ()


FULL = Suite(
    num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
    decode_batches=(1, 16, 64, 256), decode_ctx=(512, 2048, 4096, 8192, 32768),
    splits=(1, 2, 4, 8, 16, 32, 64),
    prefill_lens=(1024, 2048, 4096, 8192, 16384),
    chunks=((512, 8192), (2048, 16384), (1024, 4096)),
    mixed=(1024, 4096, 64, 4096),
    decode_sweep_points=((64, 4096, 2), (1, 32768, 32), (256, 8192, 1), (16, 8192, 8)),
    prefill_sweep_lens=(4096, 16384),
    # Candidates picked from sm_90 compiles on the CPU (registers, spills, K/V buffers the pipeliner
    # keeps; see docs/kernels-attention.md): no spills, 1-2 buffers, 1-4 CTAs per SM.
    decode_candidates={
        "bf16": (AttnConfig(16, 64, 4, 2), AttnConfig(16, 128, 4, 2), AttnConfig(16, 64, 4, 5),
                 AttnConfig(16, 32, 4, 6), AttnConfig(16, 64, 4, 3), AttnConfig(16, 128, 8, 2)),
        "fp8": (AttnConfig(16, 128, 4, 5), AttnConfig(16, 64, 4, 5), AttnConfig(16, 64, 8, 5),
                AttnConfig(16, 128, 8, 2), AttnConfig(16, 128, 4, 2), AttnConfig(16, 64, 4, 2),
                AttnConfig(16, 128, 8, 5), AttnConfig(16, 256, 8, 3)),
    },
    prefill_candidates=(AttnConfig(128, 64, 8, 3), AttnConfig(128, 64, 8, 4), AttnConfig(128, 64, 8, 2),
                        AttnConfig(128, 128, 8, 2), AttnConfig(128, 128, 8, 3), AttnConfig(64, 64, 4, 3),
                        AttnConfig(64, 64, 4, 4), AttnConfig(128, 32, 8, 3)),
)

SMOKE = Suite(
    num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
    decode_batches=(1, 3), decode_ctx=(40, 100), splits=(1, 2, 4),
    prefill_lens=(48, 96), chunks=((16, 80),), mixed=(24, 56, 3, 40),
    decode_sweep_points=((3, 100, 2),), prefill_sweep_lens=(96,),
    decode_candidates={"bf16": (AttnConfig(16, 16, 4, 2), AttnConfig(16, 32, 4, 2)),
                       "fp8": (AttnConfig(16, 32, 4, 2),)},
    prefill_candidates=(AttnConfig(32, 16, 4, 2), AttnConfig(64, 32, 4, 2)),
)


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------ timing


def measure_ceilings(device: torch.device) -> dict:
    if device.type != "cuda":
        return dict(FALLBACK, measured=False)
    src = torch.empty(2**31, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_us = time_eager([lambda: dst.copy_(src)], 10)
    src = dst = None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_us = time_eager([lambda: a @ b], 10)
    return {"copy_TBps": 2 * 2**31 / copy_us / 1e6, "bf16_TFLOPs": 2 * n**3 / mm_us / 1e6, "measured": True}


# ------------------------------------------------------------------------------------------------ data


class Pool:
    """One paged KV pool (BF16, plus its FP8 quantization) shared by every shape; each shape draws its
    blocks from a random permutation, so block tables are scattered like a long-running cache's."""

    def __init__(self, suite: Suite, num_blocks: int, device: torch.device, with_fp8: bool) -> None:
        shape = (num_blocks, suite.block_size, suite.num_kv_heads, suite.head_size)
        self.k = torch.empty(shape, dtype=torch.bfloat16, device=device)
        self.v = torch.empty_like(self.k)
        self.k8 = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device) if with_fp8 else None
        self.v8 = torch.empty_like(self.k8) if with_fp8 else None
        step = max(1, 2**28 // (self.k[0].numel() * 2))
        for lo in range(0, num_blocks, step):
            for t, t8 in ((self.k, self.k8), (self.v, self.v8)):
                t[lo:lo + step].normal_()
                if t8 is not None:
                    t8[lo:lo + step] = (t[lo:lo + step].float() / FP8_SCALE).to(torch.float8_e4m3fn)
        self.num_blocks = num_blocks
        self.perm = torch.randperm(num_blocks, device=device).to(torch.int32)
        self.device = device
        self.suite = suite

    def caches(self, fp8: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
        return (self.k8, self.v8, FP8_SCALE) if fp8 else (self.k, self.v, 1.0)

    def tables(self, batch: int, blocks_per_seq: int, rotations: int) -> list[torch.Tensor]:
        need = batch * blocks_per_seq
        out = []
        for r in range(rotations):
            lo = (r * need) % max(1, self.num_blocks - need + 1)
            out.append(self.perm[lo:lo + need].view(batch, blocks_per_seq).contiguous())
        return out


def rotations_for(kv_bytes: int) -> int:
    return max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / max(kv_bytes, 1))))


def suite_rotations(suite: Suite) -> int:
    return 1 if suite is SMOKE else MAX_ROTATIONS


def gather_kv(pool: Pool, table_row: torch.Tensor, length: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V `[length, H_kv, D]` in float32, dequantized."""
    k_cache, v_cache, scale = pool.caches(fp8)
    blocks = table_row[: -(-length // pool.suite.block_size)].long()
    hkv, d = pool.suite.num_kv_heads, pool.suite.head_size
    k = take_blocks(k_cache, blocks).reshape(-1, hkv, d)[:length].float() * scale
    v = take_blocks(v_cache, blocks).reshape(-1, hkv, d)[:length].float() * scale
    return k, v


def take_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    # indexing through a byte view works for every cache dtype, FP8 included
    return cache.view(torch.uint8)[blocks].view(cache.dtype)


def rows_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Float32 attention of query rows q `[R, H, D]` at `positions` over keys [0, position]."""
    rows, num_heads, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(rows, hkv, num_heads // hkv, d)
    scores = torch.einsum("rhgd,khd->rhgk", qg, k) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.einsum("rhgk,khd->rhgd", torch.softmax(scores, dim=-1), v).reshape(rows, num_heads, d)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poisoned(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


# ------------------------------------------------------------------------------------------------ decode


@dataclass
class DecodeShape:
    batch: int
    ctx: int
    fp8: bool
    q: list[torch.Tensor]
    out: list[torch.Tensor]
    tables: list[torch.Tensor]
    qsl: torch.Tensor
    seq_lens: torch.Tensor

    def kv_bytes(self, suite: Suite) -> int:
        element = 1 if self.fp8 else 2
        return 2 * self.batch * self.ctx * suite.num_kv_heads * suite.head_size * element

    def io_bytes(self, suite: Suite) -> int:
        return self.kv_bytes(suite) + 2 * 2 * self.batch * suite.num_heads * suite.head_size


def make_decode(pool: Pool, batch: int, ctx: int, fp8: bool, gen: torch.Generator) -> DecodeShape:
    s = pool.suite
    nb = -(-ctx // s.block_size)
    kv_bytes = 2 * batch * ctx * s.num_kv_heads * s.head_size * (1 if fp8 else 2)
    rot = min(rotations_for(kv_bytes), suite_rotations(s), max(1, pool.num_blocks // (batch * nb)))
    dev = pool.device
    q = [torch.randn(batch, s.num_heads, s.head_size, generator=gen, device=dev).to(torch.bfloat16)
         for _ in range(rot)]
    out = [poisoned((batch, s.num_heads, s.head_size), dev) for _ in range(rot)]
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return DecodeShape(batch, ctx, fp8, q, out, pool.tables(batch, nb, rot), qsl, seq_lens)


def decode_calls(pool: Pool, shp: DecodeShape, splits: int | None, cfg: AttnConfig | None,
                 seq_len_hint: bool = True) -> list[Callable[[], object]]:
    """max_query_len=1 always (a decode batch, also what a decode CUDA graph knows); max_seq_len only with
    `seq_len_hint` (a graph replayed at other lengths must not depend on it)."""
    k_cache, v_cache, scale = pool.caches(shp.fp8)
    sm_scale = pool.suite.head_size**-0.5
    calls = []
    for q, out, table in zip(shp.q, shp.out, shp.tables):
        def call(q=q, out=out, table=table):
            return attn.paged_attention(q, k_cache, v_cache, shp.qsl, shp.seq_lens, table, sm_scale,
                                        k_scale=scale, v_scale=scale, out=out,
                                        max_query_len=1, max_seq_len=shp.ctx if seq_len_hint else None,
                                        num_splits=splits, decode_cfg=cfg)
        calls.append(call)
    return calls


def check_decode(pool: Pool, shp: DecodeShape, calls: list[Callable[[], object]]) -> float:
    """Poison the outputs, run every rotation once, compare three sequences of each against float32."""
    for o in shp.out:
        o.fill_(float("nan"))
    for c in calls:
        c()
    worst = 0.0
    sm_scale = pool.suite.head_size**-0.5
    for r in range(len(calls)):
        if not torch.isfinite(shp.out[r].float()).all():
            return float("inf")
        for s in sorted({0, shp.batch // 2, shp.batch - 1}) if r == 0 or r == len(calls) - 1 else ():
            k, v = gather_kv(pool, shp.tables[r][s], shp.ctx, shp.fp8)
            pos = torch.tensor([shp.ctx - 1], device=pool.device)
            ref = rows_reference(shp.q[r][s:s + 1], k, v, pos, sm_scale)
            worst = max(worst, rel_err(shp.out[r][s:s + 1], ref))
    return worst


def sdpa_decode(suite: Suite, batch: int, ctx: int, device: torch.device, runs: int,
                gen: torch.Generator) -> dict:
    kv_bytes = 2 * batch * ctx * suite.num_kv_heads * suite.head_size * 2
    rot = min(rotations_for(kv_bytes), suite_rotations(suite))
    sets = []
    for _ in range(rot):
        q = torch.randn(batch, suite.num_heads, 1, suite.head_size, generator=gen, device=device).to(torch.bfloat16)
        k = torch.randn(batch, suite.num_kv_heads, ctx, suite.head_size, generator=gen, device=device,
                        dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sets.append((q, k, v))
    q, k, v = sets[0]
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    ref = rows_reference(q[:1, :, 0], k[0].transpose(0, 1).float(), v[0].transpose(0, 1).float(),
                         torch.tensor([ctx - 1], device=device), suite.head_size**-0.5)
    err = rel_err(out[:1, :, 0], ref)
    calls = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for q, k, v in sets]
    us, graph = time_calls(calls, runs, device)
    io = kv_bytes + 2 * 2 * batch * suite.num_heads * suite.head_size
    del sets, calls
    return {"us": us, "TBps": io / us / 1e6, "err": err, "graph": graph}


# ------------------------------------------------------------------------------------------------ prefill


@dataclass
class PrefillShape:
    query_len: int
    ctx: int
    q: torch.Tensor
    out: torch.Tensor
    table: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor

    def flops(self, suite: Suite) -> float:
        # query row i (0-based) sees ctx - query_len + i + 1 keys; causal full prefill ~ L^2 / 2 pairs
        past = self.ctx - self.query_len
        pairs = self.query_len * past + self.query_len * (self.query_len + 1) / 2
        if past == 0:
            pairs = self.query_len**2 / 2  # the convention of BENCHMARKS.md's SDPA anchors
        return 4.0 * suite.num_heads * suite.head_size * pairs


def make_prefill(pool: Pool, query_len: int, ctx: int, gen: torch.Generator) -> PrefillShape:
    s = pool.suite
    dev = pool.device
    nb = -(-ctx // s.block_size)
    q = torch.randn(query_len, s.num_heads, s.head_size, generator=gen, device=dev).to(torch.bfloat16)
    return PrefillShape(query_len, ctx, q, poisoned(tuple(q.shape), dev), pool.tables(1, nb, 1)[0],
                        torch.tensor([0, query_len], dtype=torch.int32, device=dev),
                        torch.tensor([ctx], dtype=torch.int32, device=dev))


def prefill_call(pool: Pool, shp: PrefillShape, cfg: AttnConfig | None) -> Callable[[], object]:
    sm_scale = pool.suite.head_size**-0.5
    return lambda: attn.paged_attention(shp.q, pool.k, pool.v, shp.qsl, shp.seq_lens, shp.table, sm_scale,
                                        out=shp.out, max_query_len=shp.query_len, max_seq_len=shp.ctx,
                                        prefill_cfg=cfg)


def check_prefill(pool: Pool, shp: PrefillShape, call: Callable[[], object], gen: torch.Generator) -> float:
    shp.out.fill_(float("nan"))
    call()
    if not torch.isfinite(shp.out.float()).all():
        return float("inf")
    n = min(48, shp.query_len)
    rows = torch.cat([torch.arange(8, device=pool.device),
                      torch.randint(0, shp.query_len, (n - 16,), generator=gen, device=pool.device),
                      torch.arange(shp.query_len - 8, shp.query_len, device=pool.device)]).clamp(0, shp.query_len - 1)
    k, v = gather_kv(pool, shp.table[0], shp.ctx, False)
    pos = rows + (shp.ctx - shp.query_len)
    ref = rows_reference(shp.q[rows], k, v, pos, pool.suite.head_size**-0.5)
    return rel_err(shp.out[rows], ref)


def sdpa_prefill(suite: Suite, query_len: int, ctx: int, device: torch.device, runs: int,
                 gen: torch.Generator) -> dict:
    """Best of SDPA with enable_gqa and SDPA over KV expanded to every query head (contiguous)."""
    q = torch.randn(1, suite.num_heads, query_len, suite.head_size, generator=gen, device=device).to(torch.bfloat16)
    k = torch.randn(1, suite.num_kv_heads, ctx, suite.head_size, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    group = suite.num_heads // suite.num_kv_heads
    ke = k.repeat_interleave(group, dim=1).contiguous()
    ve = v.repeat_interleave(group, dim=1).contiguous()
    if query_len == ctx:
        kw: dict = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        kw = {"attn_mask": causal_lower_right(query_len, ctx)}
    variants = {"gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw),
                "expanded": lambda: F.scaled_dot_product_attention(q, ke, ve, **kw)}
    rows = torch.cat([torch.arange(4, device=device), torch.arange(query_len - 4, query_len, device=device)])
    pos = rows + (ctx - query_len)
    ref = rows_reference(q[0].transpose(0, 1)[rows], k[0].transpose(0, 1).float(), v[0].transpose(0, 1).float(),
                         pos, suite.head_size**-0.5)
    best: dict = {}
    for name, fn in variants.items():
        try:
            out = fn()
            err = rel_err(out[0].transpose(0, 1)[rows], ref)
            us, graph = time_calls([fn], runs, device)
        except Exception as exc:  # a backend that refuses the mask or the shape
            log(f"  sdpa {name} L={query_len} ctx={ctx}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        if err < ERR_LIMIT and (not best or us < best["us"]):
            best = {"us": us, "variant": name, "err": err, "graph": graph}
    return best


# ------------------------------------------------------------------------------------------------ sweeps


def sweep_decode_configs(pool: Pool, suite: Suite, runs: int, gen: torch.Generator) -> tuple[dict, list[dict]]:
    rows = []
    chosen: dict[str, AttnConfig] = {}
    for kind, cands in suite.decode_candidates.items():
        fp8 = kind == "fp8"
        scores: dict[AttnConfig, float] = {}
        for batch, ctx, splits in suite.decode_sweep_points:
            shp = make_decode(pool, batch, ctx, fp8, gen)
            times = {}
            for cfg in cands:
                calls = decode_calls(pool, shp, splits, cfg)
                err = check_decode(pool, shp, calls)
                if err > ERR_LIMIT:
                    log(f"  decode cfg {cfg} {kind} B={batch} ctx={ctx}: error {err:.2e}, skipped")
                    continue
                us, _ = time_calls(calls, runs, pool.device)
                times[cfg] = us
                rows.append({"kind": kind, "batch": batch, "ctx": ctx, "splits": splits, "config": asdict(cfg),
                             "us": us, "TBps": shp.io_bytes(suite) / us / 1e6, "err": err})
            best = min(times.values(), default=1.0)
            for cfg, us in times.items():
                scores[cfg] = scores.get(cfg, 0.0) + us / best
            del shp
        complete = {c: s for c, s in scores.items() if sum(1 for r in rows if r["kind"] == kind
                                                           and AttnConfig(**r["config"]) == c)
                    == len(suite.decode_sweep_points)}
        chosen[kind] = min(complete, key=complete.get) if complete else attn.decode_config(
            suite.head_size, suite.num_heads // suite.num_kv_heads, fp8)
        log(f"decode {kind}: chose {chosen[kind]} (sum of time / best over points: "
            f"{complete.get(chosen[kind], float('nan')):.3f})")
    return chosen, rows


def sweep_prefill_configs(pool: Pool, suite: Suite, runs: int, gen: torch.Generator) -> tuple[AttnConfig, list[dict]]:
    rows = []
    scores: dict[AttnConfig, list[float]] = {}
    for length in suite.prefill_sweep_lens:
        shp = make_prefill(pool, length, length, gen)
        times = {}
        for cfg in suite.prefill_candidates:
            call = prefill_call(pool, shp, cfg)
            try:
                err = check_prefill(pool, shp, call, gen)
            except Exception as exc:  # e.g. a tile that needs more shared memory than the GPU has
                log(f"  prefill cfg {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            if err > ERR_LIMIT:
                log(f"  prefill cfg {cfg} L={length}: error {err:.2e}, skipped")
                continue
            us, _ = time_calls([call], runs, pool.device)
            times[cfg] = us
            rows.append({"L": length, "config": asdict(cfg), "us": us, "TFLOPs": shp.flops(suite) / us / 1e6,
                         "err": err})
        best = min(times.values(), default=1.0)
        for cfg, us in times.items():
            scores.setdefault(cfg, []).append(us / best)
    complete = {c: sum(v) for c, v in scores.items() if len(v) == len(suite.prefill_sweep_lens)}
    chosen = min(complete, key=complete.get) if complete else attn.prefill_config(
        suite.head_size, suite.num_heads // suite.num_kv_heads)
    log(f"prefill: chose {chosen}")
    return chosen, rows


# ------------------------------------------------------------------------------------------------ benchmark


def bench_decode(pool: Pool, suite: Suite, cfgs: dict[str, AttnConfig], runs: int, gen: torch.Generator,
                 ceilings: dict, save: Callable[[], None], results: dict, deadline: float) -> None:
    """Every split count at every shape: the table that picks the split heuristic comes from here.
    Past the deadline only the split counts a power of four apart are tried."""
    device = pool.device
    sweep = results.setdefault("split_sweep", [])
    decode = results.setdefault("decode", [])
    for batch in suite.decode_batches:
        for ctx in suite.decode_ctx:
            anchor = sdpa_decode(suite, batch, ctx, device, runs, gen)
            entry: dict = {"batch": batch, "ctx": ctx, "sdpa_us": anchor["us"], "sdpa_TBps": anchor["TBps"],
                           "sdpa_err": anchor["err"]}
            for kind in ("bf16", "fp8"):
                fp8 = kind == "fp8"
                shp = make_decode(pool, batch, ctx, fp8, gen)
                best = None
                for splits in suite.splits:
                    if splits > 1 and batch * suite.num_kv_heads * splits > 64 * 132:
                        continue  # far past filling the GPU: partials only cost
                    if time.time() > deadline and splits not in (1, 4, 16, 64):
                        continue
                    calls = decode_calls(pool, shp, splits, cfgs[kind])
                    err = check_decode(pool, shp, calls)
                    us = time_calls(calls, runs, device)[0] if err <= ERR_LIMIT else float("inf")
                    row = {"kind": kind, "batch": batch, "ctx": ctx, "splits": splits, "us": us,
                           "TBps": shp.io_bytes(suite) / us / 1e6, "err": err}
                    sweep.append(row)
                    if best is None or us < best["us"]:
                        best = row
                # the launcher's own choice with the host hint, and without (CUDA-graph mode)
                for label, hint in (("auto", True), ("graph", False)):
                    calls = decode_calls(pool, shp, None, cfgs[kind], seq_len_hint=hint)
                    err = check_decode(pool, shp, calls)
                    us = time_calls(calls, runs, device)[0] if err <= ERR_LIMIT else float("inf")
                    entry[f"{kind}_{label}_us"] = us
                    entry[f"{kind}_{label}_TBps"] = shp.io_bytes(suite) / us / 1e6
                    entry[f"{kind}_{label}_err"] = err
                entry[f"{kind}_best_splits"] = best["splits"]
                entry[f"{kind}_best_us"] = best["us"]
                entry[f"{kind}_best_TBps"] = best["TBps"]
                entry[f"{kind}_io_bytes"] = shp.io_bytes(suite)
                del shp
            decode.append(entry)
            apply_split_rules(results, suite, attn.num_sms(device))
            log(f"decode B={batch:<3} ctx={ctx:<5}: bf16 {entry['bf16_best_us']:8.1f} us "
                f"{entry['bf16_best_TBps']:.2f} TB/s (s={entry['bf16_best_splits']}, auto "
                f"{entry['bf16_auto_us']:.1f}, graph {entry['bf16_graph_us']:.1f}) | "
                f"fp8 {entry['fp8_best_us']:8.1f} us "
                f"(s={entry['fp8_best_splits']}) x{entry['fp8_speedup']:.2f} | sdpa {anchor['us']:8.1f} us "
                f"{anchor['TBps']:.2f} TB/s")
            save()


def bench_prefill(pool: Pool, suite: Suite, cfg: AttnConfig, runs: int, gen: torch.Generator,
                  save: Callable[[], None], results: dict) -> None:
    rows = results.setdefault("prefill", [])
    for query_len, ctx in [(n, n) for n in suite.prefill_lens] + list(suite.chunks):
        shp = make_prefill(pool, query_len, ctx, gen)
        call = prefill_call(pool, shp, cfg)
        err = check_prefill(pool, shp, call, gen)
        us = time_calls([call], runs, pool.device)[0] if err <= ERR_LIMIT else float("inf")
        anchor = sdpa_prefill(suite, query_len, ctx, pool.device, runs, gen)
        flops = shp.flops(suite)
        row = {"query_len": query_len, "ctx": ctx, "us": us, "TFLOPs": flops / us / 1e6, "err": err,
               "sdpa_us": anchor.get("us"), "sdpa_variant": anchor.get("variant"),
               "sdpa_TFLOPs": flops / anchor["us"] / 1e6 if anchor else None}
        row["vs_sdpa"] = anchor["us"] / us if anchor else None
        rows.append(row)
        vs = f"{row['vs_sdpa']:.2f}x" if anchor else "-"
        sd = f"{row['sdpa_TFLOPs']:.0f}" if anchor else "-"
        log(f"prefill q={query_len:<5} ctx={ctx:<5}: {us:8.1f} us {row['TFLOPs']:.0f} TFLOP/s | sdpa {sd} ({vs})")
        del shp
        save()


def bench_mixed(pool: Pool, suite: Suite, cfgs: dict[str, AttnConfig], pre_cfg: AttnConfig, runs: int,
                gen: torch.Generator, results: dict) -> None:
    """One chunk over cached context plus decodes in one flat batch, against the two parts run alone."""
    chunk, chunk_ctx, decodes, dec_ctx = suite.mixed
    s = suite
    dev = pool.device
    nb_c, nb_d = -(-chunk_ctx // s.block_size), -(-dec_ctx // s.block_size)
    width = max(nb_c, nb_d)
    blocks = pool.tables(1, nb_c + decodes * nb_d, 1)[0].view(-1)
    table = torch.zeros(decodes + 1, width, dtype=torch.int32, device=dev)
    table[0, :nb_c] = blocks[:nb_c]
    table[1:, :nb_d] = blocks[nb_c:].view(decodes, nb_d)
    q = torch.randn(chunk + decodes, s.num_heads, s.head_size, generator=gen, device=dev).to(torch.bfloat16)
    out = poisoned(tuple(q.shape), dev)
    qsl = torch.tensor([0, *range(chunk, chunk + decodes + 1)], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([chunk_ctx] + [dec_ctx] * decodes, dtype=torch.int32, device=dev)
    sm = s.head_size**-0.5

    def mixed() -> torch.Tensor:
        return attn.paged_attention(q, pool.k, pool.v, qsl, seq_lens, table, sm, out=out, max_query_len=chunk,
                                    max_seq_len=max(chunk_ctx, dec_ctx), decode_cfg=cfgs["bf16"], prefill_cfg=pre_cfg)

    mixed()
    worst = 0.0
    for seq, (lo, n, ctx) in {0: (0, chunk, chunk_ctx), 1: (chunk, 1, dec_ctx),
                              decodes: (chunk + decodes - 1, 1, dec_ctx)}.items():
        k, v = gather_kv(pool, table[seq], ctx, False)
        rows = torch.arange(lo, lo + n, device=dev)[-32:]
        ref = rows_reference(q[rows], k, v, rows - lo + (ctx - n), sm)
        worst = max(worst, rel_err(out[rows], ref))
    us = time_calls([mixed], runs, dev)[0] if worst <= ERR_LIMIT else float("inf")
    q_dec, o_dec = q[chunk:].clone(), out[chunk:].clone()
    qsl_dec = torch.arange(decodes + 1, dtype=torch.int32, device=dev)
    only_dec = lambda: attn.paged_attention(q_dec, pool.k, pool.v, qsl_dec, seq_lens[1:], table[1:], sm, out=o_dec,
                                            max_query_len=1, max_seq_len=dec_ctx, decode_cfg=cfgs["bf16"])
    q_pre, o_pre = q[:chunk].clone(), out[:chunk].clone()
    qsl_pre = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    only_pre = lambda: attn.paged_attention(q_pre, pool.k, pool.v, qsl_pre, seq_lens[:1], table[:1], sm, out=o_pre,
                                            max_query_len=chunk, max_seq_len=chunk_ctx, prefill_cfg=pre_cfg)
    us_dec = time_calls([only_dec], runs, dev)[0]
    us_pre = time_calls([only_pre], runs, dev)[0]
    results["mixed"] = {"chunk": chunk, "chunk_ctx": chunk_ctx, "decodes": decodes, "decode_ctx": dec_ctx,
                        "us": us, "err": worst, "decode_alone_us": us_dec, "chunk_alone_us": us_pre,
                        "overhead_vs_parts": us / (us_dec + us_pre)}
    log(f"mixed: chunk {chunk}/{chunk_ctx} + {decodes} decodes@{dec_ctx}: {us:.1f} us "
        f"(parts alone {us_pre:.1f} + {us_dec:.1f})")


def bench_kv_write(pool: Pool, suite: Suite, runs: int, gen: torch.Generator, results: dict) -> None:
    """store_kv alone (BF16 and FP8 cache) against the unfused rotary embedding that a fused RoPE + KV
    write would absorb: the rotary's time bounds what fusing could save."""
    from kestrel.model.layers.rotary import RotaryEmbedding

    s = suite
    dev = pool.device
    rope = RotaryEmbedding(s.head_size, 1 << 16).to(dev)
    rows = []
    for tokens in (16, 256, 4096) if suite is FULL else (16, 64):  # one slot per pool block
        key = torch.randn(tokens, s.num_kv_heads, s.head_size, generator=gen, device=dev).to(torch.bfloat16)
        value = torch.randn_like(key)
        q = torch.randn(tokens, s.num_heads * s.head_size, generator=gen, device=dev).to(torch.bfloat16)
        pos = torch.randint(0, 1 << 15, (tokens,), generator=gen, device=dev)
        slots = pool.perm[:tokens].long() * s.block_size + 3
        row = {"tokens": tokens}
        for kind in ("bf16", "fp8"):
            k_cache, v_cache, scale = pool.caches(kind == "fp8")
            call = lambda k=key, v=value, kc=k_cache, vc=v_cache, sl=slots, sc=scale: store_kv(k, v, kc, vc, sl, sc, sc)
            row[f"store_{kind}_us"] = time_calls([call], runs, dev)[0]
        kflat = key.view(tokens, -1)
        call = lambda p=pos, q=q, k=kflat: rope(p, q, k)
        row["rope_us"] = time_calls([call], runs, dev)[0]
        rows.append(row)
        log(f"kv write T={tokens}: store bf16 {row['store_bf16_us']:.1f} us, fp8 {row['store_fp8_us']:.1f} us; "
            f"torch rotary {row['rope_us']:.1f} us")
    results["kv_write"] = rows


# ------------------------------------------------------------------------------------------------ checks


def correctness_cases() -> list[dict]:
    """Realistic-dtype cases for the GPU (bf16 activations), run in the precompile workers."""
    cases = []
    for head in (64, 128, 256):
        for heads, kv_heads in ((8, 8), (32, 8), (32, 4)):
            cases.append({"head": head, "heads": heads, "kv_heads": kv_heads})
    cases += [
        {"head": 128, "heads": 32, "kv_heads": 8, "window": 100},
        {"head": 128, "heads": 32, "kv_heads": 8, "fp8": True},
        {"head": 128, "heads": 32, "kv_heads": 8, "fp8": True, "window": 64, "splits": 3},
        {"head": 128, "heads": 32, "kv_heads": 8, "splits": 7},
        {"head": 64, "heads": 28, "kv_heads": 4, "splits": 5},  # group 7
        {"head": 256, "heads": 16, "kv_heads": 8, "fp8": True, "splits": 4},
        {"head": 96, "heads": 8, "kv_heads": 2},
        {"head": 128, "heads": 32, "kv_heads": 8, "dtype": "fp16"},
        {"head": 128, "heads": 32, "kv_heads": 8, "graph": True},
        {"head": 128, "heads": 32, "kv_heads": 8, "graph": True, "fp8": True},
    ]
    return cases


def run_case(case: dict, device: torch.device) -> dict:
    """A mixed batch (full prefill, chunks over cached context, decodes of assorted lengths, a 3-token
    query) written through the Triton store_kv, checked against paged_attention_ref in float32."""
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(json.dumps(case, sort_keys=True).encode()))
    head, heads, kv_heads = case["head"], case["heads"], case["kv_heads"]
    dtype = torch.float16 if case.get("dtype") == "fp16" else torch.bfloat16
    fp8 = case.get("fp8", False)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    k_scale, v_scale = (0.021, 0.017) if fp8 else (1.0, 1.0)
    seqs = [(300, 300), (700, 129), (1500, 1), (90, 1), (17, 1), (260, 3), (1, 1), (1200, 64)]
    if case.get("small"):
        seqs = [(30, 30), (50, 9), (70, 1), (9, 1), (40, 3), (1, 1)]
    if case.get("graph"):
        seqs = [(ctx, 1) for ctx in (1500, 90, 17, 777, 1, 400)]
    bs = 16
    nblocks = sum(-(-c // bs) for c, _ in seqs) + 64
    k_cache = torch.full((nblocks, bs, kv_heads, head), float("nan"), device=device).to(cache_dtype)
    v_cache = torch.full((nblocks, bs, kv_heads, head), float("nan"), device=device).to(cache_dtype)
    used = []
    perm = torch.randperm(nblocks, generator=gen, device=device).tolist()
    width = max(-(-c // bs) for c, _ in seqs) + 64  # room for the graph case to grow
    table = torch.zeros(len(seqs), width, dtype=torch.int32, device=device)
    for s, (ctx, _) in enumerate(seqs):
        n = -(-ctx // bs)
        blocks = [perm.pop() for _ in range(n)]
        used.append(n)
        table[s, :n] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(ctx)], device=device)
        key = torch.randn(ctx, kv_heads, head, generator=gen, device=device).to(dtype)
        value = torch.randn(ctx, kv_heads, head, generator=gen, device=device).to(dtype)
        store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    lens = [n for _, n in seqs]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens), heads, head, generator=gen, device=device).to(dtype)
    scale = head**-0.5
    window = case.get("window")
    kw = dict(sliding_window=window, k_scale=k_scale, v_scale=v_scale)

    def ref() -> torch.Tensor:
        # float32 copies of the caches: the reference gathers blocks, which FP8 tensors cannot do
        return attn.paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), qsl, seq_lens, table, scale,
                                        **kw)

    result = {"case": case}
    if case.get("graph"):
        out = torch.full_like(q, float("nan"))
        call = lambda: attn.paged_attention(q, k_cache, v_cache, qsl, seq_lens, table, scale, out=out,
                                            max_query_len=1, **kw)
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        errs = []
        for step in range(3):  # grow every context, new queries: the same graph must follow
            if step:
                seq_lens.add_(7 * step)
                q.normal_(generator=gen)
                for s in range(len(seqs)):
                    n = -(-int(seq_lens[s]) // bs)
                    while used[s] < n:
                        table[s, used[s]] = perm.pop()
                        used[s] += 1
                    for p in range(int(seq_lens[s]) - 7 * step, int(seq_lens[s])):
                        slot = torch.tensor([int(table[s, p // bs]) * bs + p % bs], device=device)
                        kv = torch.randn(1, kv_heads, head, generator=gen, device=device).to(dtype)
                        store_kv(kv, kv, k_cache, v_cache, slot, k_scale, v_scale)
            out.fill_(float("nan"))
            graph.replay()
            errs.append(rel_err(out, ref()))
        result["err"] = max(errs)
    else:
        out = attn.paged_attention(q, k_cache, v_cache, qsl, seq_lens, table, scale, num_splits=case.get("splits"),
                                   **kw)
        result["err"] = rel_err(out, ref())
        hinted = attn.paged_attention(q, k_cache, v_cache, qsl, seq_lens, table, scale, max_query_len=max(lens),
                                      max_seq_len=max(c for c, _ in seqs), **kw)
        result["err_hinted"] = rel_err(hinted, ref())
    result["ok"] = max(result["err"], result.get("err_hinted", 0.0)) < ERR_LIMIT
    return result


def store_kv_check(device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    errs = {}
    for name, cache_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        key = torch.randn(300, 8, 128, generator=gen, device=device).to(torch.bfloat16) * 4
        value = torch.randn(300, 8, 128, generator=gen, device=device).to(torch.bfloat16)
        key[0, 0, 0] = 1e4  # saturates in FP8
        slots = torch.randperm(64 * 16, generator=gen, device=device)[:300]
        slots[::7] = -1
        caches = [torch.randn(64, 16, 8, 128, generator=gen, device=device).to(cache_dtype) for _ in range(2)]
        want = [c.clone() for c in caches]
        store_kv_ref(key, value, want[0], want[1], slots, 0.05, 0.01)
        store_kv(key, value, caches[0], caches[1], slots, 0.05, 0.01)
        errs[name] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(want, caches))
    return {"case": "store_kv", "ok": all(errs.values()), "exact": errs}


# ------------------------------------------------------------------------------------------------ precompile


def _worker(tasks: list[dict]) -> list[dict]:
    """Compile (one small launch per kernel variant) and run correctness cases, in a worker process."""
    device = torch.device("cuda")
    out = []
    for task in tasks:
        try:
            if task["what"] == "case":
                out.append(run_case(task["case"], device))
            elif task["what"] == "store_kv":
                out.append(store_kv_check(device))
            else:
                _warm(task, device)
        except Exception as exc:
            out.append({"case": task, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return out


def _warm(task: dict, device: torch.device) -> None:
    """The same specialization as the benchmark's launches (divisible strides, dtypes, constexprs)."""
    s = FULL
    fp8 = task.get("fp8", False)
    pool_shape = (96, s.block_size, s.num_kv_heads, s.head_size)
    k = torch.randn(pool_shape, device=device).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    v = k.clone()
    table = torch.arange(96, dtype=torch.int32, device=device).view(3, 32)
    sm = s.head_size**-0.5
    if task["what"] == "decode":
        cfg = AttnConfig(**task["cfg"])
        q = torch.randn(3, s.num_heads, s.head_size, device=device).to(torch.bfloat16)
        qsl = torch.arange(4, dtype=torch.int32, device=device)
        lens = torch.full((3,), 500, dtype=torch.int32, device=device)
        for splits in (1, 2):
            attn.paged_attention(q, k, v, qsl, lens, table, sm, k_scale=0.5, v_scale=0.5, out=torch.empty_like(q),
                                 max_query_len=1, max_seq_len=500, num_splits=splits, decode_cfg=cfg)
    else:
        cfg = AttnConfig(**task["cfg"]) if task.get("cfg") else None
        q = torch.randn(320, s.num_heads, s.head_size, device=device).to(torch.bfloat16)
        qsl = torch.tensor([0, 320], dtype=torch.int32, device=device)
        lens = torch.tensor([480], dtype=torch.int32, device=device)
        attn.paged_attention(q, k, v, qsl, lens, table[:1], sm, out=torch.empty_like(q), max_query_len=320,
                             max_seq_len=480, prefill_cfg=cfg)
    torch.cuda.synchronize()


def precompile_and_check(suite: Suite, jobs: int, with_checks: bool) -> list[dict]:
    tasks: list[dict] = []
    if with_checks:
        tasks += [{"what": "case", "case": c} for c in correctness_cases()] + [{"what": "store_kv"}]
    for kind, cands in suite.decode_candidates.items():
        for cfg in cands:
            tasks.append({"what": "decode", "cfg": asdict(cfg), "fp8": kind == "fp8"})
    tasks += [{"what": "prefill", "cfg": asdict(c)} for c in suite.prefill_candidates]
    tasks.append({"what": "prefill", "cfg": None})
    t0 = time.time()
    chunks = [tasks[i::jobs] for i in range(jobs) if tasks[i::jobs]]
    with ProcessPoolExecutor(max_workers=len(chunks), mp_context=get_context("spawn")) as pool:
        results = [r for part in pool.map(_worker, chunks) for r in part]
    log(f"precompile + checks: {len(tasks)} tasks on {len(chunks)} processes in {time.time() - t0:.1f}s")
    return results


# ------------------------------------------------------------------------------------------------ report


def split_table(rows: list[dict], batches: tuple[int, ...], contexts: tuple[int, ...]) -> dict:
    """Best split per (kind, batch, ctx), and per (kind, batch) the one split that loses least over all
    contexts (what a CUDA graph, which does not know the context, should use)."""
    table: dict = {}
    for kind in ("bf16", "fp8"):
        per_shape, per_batch = {}, {}
        for b in batches:
            losses: dict[int, float] = {}
            for c in contexts:
                cand = [r for r in rows if r["kind"] == kind and r["batch"] == b and r["ctx"] == c]
                if not cand:
                    continue
                best = min(cand, key=lambda r: r["us"])
                per_shape[f"{b}x{c}"] = best["splits"]
                for r in cand:
                    losses[r["splits"]] = max(losses.get(r["splits"], 0.0), r["us"] / best["us"])
            if losses:
                per_batch[str(b)] = min(losses, key=losses.get)
                per_batch[f"{b}_worst_loss"] = min(losses.values())
        table[kind] = {"best_per_shape": per_shape, "graph_per_batch": per_batch}
    return table


def apply_split_rules(results: dict, suite: Suite, sms: int) -> None:
    """Per decode shape, the splits the launcher's rules choose (with the context length known, and blind
    as in a CUDA graph) and their times, read from this run's split sweep (every split was timed there),
    then the summary ratios from the rule's numbers."""
    sweep = results.get("split_sweep", [])
    for e in results.get("decode", []):
        for kind in ("bf16", "fp8"):
            times = {r["splits"]: r["us"] for r in sweep
                     if r["kind"] == kind and r["batch"] == e["batch"] and r["ctx"] == e["ctx"]}
            for label, hint in (("rule", e["ctx"]), ("blind", None)):
                splits = attn.splits_for(e["batch"], suite.num_kv_heads, sms, hint, kind == "fp8")
                us = times.get(splits, float("nan"))
                e[f"{kind}_{label}_splits"] = splits
                e[f"{kind}_{label}_us"] = us
                e[f"{kind}_{label}_TBps"] = e[f"{kind}_io_bytes"] / us / 1e6
        e["bf16_frac_copy"] = e["bf16_rule_TBps"] / results["ceilings"]["copy_TBps"]
        e["bf16_vs_sdpa"] = e["sdpa_us"] / e["bf16_rule_us"]
        e["fp8_speedup"] = e["bf16_rule_us"] / e["fp8_rule_us"]


def evaluate_targets(results: dict, ceilings: dict) -> list[dict]:
    """Decode targets on the numbers of the launcher's split rule (host hint), prefill on the chosen tile."""
    copy = ceilings["copy_TBps"]
    out = []
    for e in results.get("decode", []):
        if "bf16_rule_us" not in e:
            continue
        out.append({"target": f"decode {e['batch']}x{e['ctx']} bf16 >= SDPA contiguous",
                    "value": round(e["bf16_vs_sdpa"], 3), "met": e["bf16_vs_sdpa"] >= 1.0})
        if e["batch"] >= 64 and e["ctx"] >= 4096:
            out.append({"target": f"decode {e['batch']}x{e['ctx']} bf16 >= 0.85 of copy bandwidth",
                        "value": round(e["bf16_frac_copy"], 3), "met": e["bf16_frac_copy"] >= 0.85})
        if e["batch"] == 1 and e["ctx"] == 32768:
            out.append({"target": "decode 1x32k (split-KV) >= 0.70 of copy bandwidth",
                        "value": round(e["bf16_rule_TBps"] / copy, 3), "met": e["bf16_rule_TBps"] / copy >= 0.70})
        if e["ctx"] >= 8192:
            out.append({"target": f"decode {e['batch']}x{e['ctx']} FP8 KV >= 1.7x BF16 KV",
                        "value": round(e["fp8_speedup"], 3), "met": e["fp8_speedup"] >= 1.7})
    for p in results.get("prefill", []):
        if p["query_len"] == p["ctx"] and p["vs_sdpa"] is not None:
            out.append({"target": f"prefill {p['query_len']} >= 0.9x SDPA", "value": round(p["vs_sdpa"], 3),
                        "met": p["vs_sdpa"] >= 0.9})
    return out


def summary(results: dict, ceilings: dict) -> str:
    lines = [f"copy {ceilings['copy_TBps']:.2f} TB/s, bf16 mm {ceilings['bf16_TFLOPs']:.0f} TFLOP/s",
             "decode (split rule; best split's us)",
             "  B x ctx     | bf16 us (best)    TB/s %copy spl | fp8 us (best)     TB/s x bf16 spl | SDPA us  TB/s"
             " | vs SDPA"]
    for e in results.get("decode", []):
        if "bf16_rule_us" not in e:
            continue
        lines.append(
            f"{e['batch']:>4} x {e['ctx']:<6} | {e['bf16_rule_us']:7.1f} ({e['bf16_best_us']:7.1f}) "
            f"{e['bf16_rule_TBps']:5.2f} {100 * e['bf16_frac_copy']:5.1f} {e['bf16_rule_splits']:>3} | "
            f"{e['fp8_rule_us']:7.1f} ({e['fp8_best_us']:7.1f}) {e['fp8_rule_TBps']:5.2f} {e['fp8_speedup']:6.2f} "
            f"{e['fp8_rule_splits']:>3} | {e['sdpa_us']:7.1f} {e['sdpa_TBps']:5.2f} | {e['bf16_vs_sdpa']:.2f}")
    lines.append("prefill q / ctx    | us        TFLOP/s | SDPA TFLOP/s | vs SDPA")
    for p in results.get("prefill", []):
        sd = f"{p['sdpa_TFLOPs']:8.0f}" if p["sdpa_TFLOPs"] else "       -"
        vs = f"{p['vs_sdpa']:.2f}" if p["vs_sdpa"] else "-"
        lines.append(f"{p['query_len']:>6} / {p['ctx']:<6} | {p['us']:9.1f} {p['TFLOPs']:7.0f} | {sd}     | {vs}")
    m = results.get("mixed")
    if m:
        lines.append(f"mixed: {m['us']:.1f} us vs parts {m['chunk_alone_us']:.1f} + {m['decode_alone_us']:.1f}")
    missed = [t for t in results.get("targets", []) if not t["met"]]
    lines.append(f"targets: {sum(t['met'] for t in results.get('targets', []))}/{len(results.get('targets', []))} met")
    lines += [f"  MISSED {t['target']}: {t['value']}" for t in missed]
    return "\n".join(lines)


def plot(results: dict, ceilings: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5))
    decode = [e for e in results.get("decode", []) if "bf16_rule_TBps" in e]
    labels = [f"{e['batch']}x{e['ctx'] // 1024 if e['ctx'] >= 1024 else e['ctx']}{'k' if e['ctx'] >= 1024 else ''}"
              for e in decode]
    x = range(len(decode))
    ax1.plot(x, [e["bf16_rule_TBps"] for e in decode], "o-", label="ours, BF16 KV")
    ax1.plot(x, [e["fp8_rule_TBps"] for e in decode], "s-", label="ours, FP8 KV (bytes actually read)")
    ax1.plot(x, [e["sdpa_TBps"] for e in decode], "^--", label="SDPA, contiguous BF16 KV")
    ax1.axhline(ceilings["copy_TBps"], color="k", lw=1, label=f"copy {ceilings['copy_TBps']:.2f} TB/s")
    ax1.axhline(0.85 * ceilings["copy_TBps"], color="gray", lw=0.8, ls=":", label="0.85 x copy")
    ax1.set_xticks(list(x), labels, rotation=60, fontsize=8)
    ax1.set_ylabel("TB/s (KV + Q + O bytes / time)")
    ax1.set_title("decode, 32 q heads / 8 KV heads x 128, batch x context")
    ax1.legend(fontsize=8)
    pre = results.get("prefill", [])
    full = [p for p in pre if p["query_len"] == p["ctx"]]
    chunks = [p for p in pre if p["query_len"] != p["ctx"]]
    ax2.plot([p["query_len"] for p in full], [p["TFLOPs"] for p in full], "o-", label="ours (paged)")
    ax2.plot([p["query_len"] for p in full], [p["sdpa_TFLOPs"] or 0 for p in full], "^--", label="SDPA (contiguous)")
    for p in chunks:
        ax2.plot([p["ctx"]], [p["TFLOPs"]], "x", color="C3")
        ax2.annotate(f"chunk {p['query_len']}/{p['ctx']}", (p["ctx"], p["TFLOPs"]), fontsize=7)
    ax2.axhline(ceilings["bf16_TFLOPs"], color="k", lw=1, label=f"bf16 mm {ceilings['bf16_TFLOPs']:.0f}")
    if full or chunks:
        ax2.set_xscale("log", base=2)
    ax2.set_xlabel("tokens (context)")
    ax2.set_ylabel("TFLOP/s")
    ax2.set_title("causal prefill, batch 1")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def environment() -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "cuda": torch.version.cuda}
    try:
        env["git_sha"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                        cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        env["git_sha"] = "unknown"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count)
    else:
        env["gpu"] = "cpu (TRITON_INTERPRET)"
    return env


# ------------------------------------------------------------------------------------------------ entry


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for JSON and PNG")
    p.add_argument("--name", default=None, help="file stem (default attention-<gpu>)")
    p.add_argument("--runs", type=int, default=50, help="timed graph replays per measurement")
    p.add_argument("--jobs", type=int, default=0, help="precompile/check processes (0: min(14, cpus))")
    p.add_argument("--no-precompile", action="store_true", help="skip the worker phase (kernels already cached)")
    p.add_argument("--precompile-only", action="store_true", help="compile and run the checks, then stop")
    p.add_argument("--no-sweep", action="store_true", help="use the tile configs in the kernel file")
    p.add_argument("--skip", default="", help="comma list of sections to skip: decode,prefill,mixed,kv_write")
    p.add_argument("--budget-s", type=float, default=0.0, help="past this many seconds, sweep fewer splits")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (run with TRITON_INTERPRET=1)")


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "attention", "paged attention benchmark (BENCHMARKS.md 'attention')",
                          add_arguments, run)


def run(args: argparse.Namespace) -> int:
    t_run = time.time()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    suite = SMOKE if args.smoke else FULL
    runs = 1 if args.smoke else max(1, args.runs)
    skip = set(filter(None, args.skip.split(",")))
    env = environment()
    stem = args.name or ("attention-smoke" if args.smoke else
                         f"attention-{env['gpu'].lower().replace('nvidia', '').strip().split()[0]}")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{stem}.json"
    log(f"env: {env}")
    results: dict = {"suite": "attention", "environment": env,
                     "config": {"suite": asdict(suite), "runs": runs, "rotate_bytes": ROTATE_BYTES,
                                "err_limit": ERR_LIMIT, "fp8_scale": FP8_SCALE,
                                "timing": "CUDA graph of one call per rotated input set; median of replays"}}
    checks: list[dict] = []
    checks_path = json_path.with_name(f"{stem}-checks.json")
    if device.type == "cuda" and args.no_precompile and checks_path.exists():
        results["checks"] = json.loads(checks_path.read_text())
    if device.type == "cuda" and not args.no_precompile:
        jobs = args.jobs or min(14, os.cpu_count() or 1)
        checks = precompile_and_check(suite, jobs, with_checks=True)
        failed = [c for c in checks if "ok" in c and not c["ok"]]
        log(f"checks: {sum(1 for c in checks if c.get('ok'))} passed, {len(failed)} failed")
        for c in failed:
            log(f"  FAILED {c}")
        results["checks"] = checks
        if args.precompile_only:
            checks_path.write_text(json.dumps(checks, indent=1) + "\n")
            return 1 if failed else 0
    elif device.type != "cuda":  # the script's own check path, on shapes the interpreter can afford
        checks = [run_case(dict(c, small=True), device) for c in correctness_cases()[:2]]
        log(f"checks (small, CPU): {[round(c['err'], 5) for c in checks]}")
        results["checks"] = checks
    ceilings = measure_ceilings(device)
    results["ceilings"] = ceilings
    log(f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, bf16 mm {ceilings['bf16_TFLOPs']:.0f} TFLOP/s")

    def save() -> None:
        results["targets"] = evaluate_targets(results, ceilings)
        json_path.write_text(json.dumps(results, indent=1) + "\n")

    gen = torch.Generator(device=device).manual_seed(0)
    max_tokens = max(max(suite.decode_batches) * max(suite.decode_ctx), max(suite.prefill_lens) * 4)
    pool = Pool(suite, -(-max_tokens // suite.block_size) + 64, device, with_fp8=True)
    group = suite.num_heads // suite.num_kv_heads
    cfgs = {k: attn.decode_config(suite.head_size, group, k == "fp8") for k in ("bf16", "fp8")}
    pre_cfg = attn.prefill_config(suite.head_size, group)
    if not args.no_sweep:
        cfgs, rows = sweep_decode_configs(pool, suite, runs, gen)
        results["decode_config_sweep"] = rows
        pre_cfg, rows = sweep_prefill_configs(pool, suite, runs, gen)
        results["prefill_config_sweep"] = rows
    results["chosen"] = {"decode": {k: asdict(v) for k, v in cfgs.items()}, "prefill": asdict(pre_cfg)}
    save()
    # decode last: it is the longest section and saves after every shape
    if "prefill" not in skip:
        bench_prefill(pool, suite, pre_cfg, runs, gen, save, results)
    if "mixed" not in skip:
        bench_mixed(pool, suite, cfgs, pre_cfg, runs, gen, results)
    if "kv_write" not in skip:
        bench_kv_write(pool, suite, runs, gen, results)
    if "decode" not in skip:
        deadline = t_run + args.budget_s if args.budget_s > 0 else float("inf")
        bench_decode(pool, suite, cfgs, runs, gen, ceilings, save, results, deadline)
        results["split_table"] = split_table(results["split_sweep"], suite.decode_batches, suite.decode_ctx)
    save()
    plotted = plot(results, ceilings, args.out / f"{stem}.png")
    log(f"wrote {json_path}" + (" and .png" if plotted else " (no matplotlib: no PNG)"))
    log(f"total {time.time() - t_run:.0f}s")
    if "split_table" in results:
        log(f"split table: {json.dumps(results['split_table'])}")
    log(summary(results, ceilings))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kestrel bench attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
