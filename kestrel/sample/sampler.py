"""Batched sampling and logprobs with vLLM semantics and no host synchronization.

Order of operations per row:
  raw logprobs = log_softmax(logits)                          (before anything else, vLLM "raw_logprobs")
  penalties    repetition (prompt + output), frequency, presence (output only)
  min_tokens   stop ids and eos masked while the output is shorter than min_tokens
  greedy rows  argmax
  other rows   / temperature -> min_p -> top_k -> top_p (over the top-k renormalized distribution)
               -> argmax(probs / q), q ~ Exp(1) from the row's generator or the shared one

Everything that depends on the batch's Python-side parameters (which paths to run, the largest
top-k, the number of logprobs) is decided in `SamplingMetadata.build`, so `Sampler.__call__`
never reads a device value back to the host.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from kestrel.outputs import Logprob
from kestrel.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-batch sampling inputs as device tensors, plus host-side flags that select the fast paths."""

    temperature: torch.Tensor  # [B] float32, 1.0 on greedy rows so the division is harmless
    greedy_mask: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64 in [1, V]; None when no row uses top-k
    max_top_k: int  # largest effective k in the batch (V when some row has it off)
    top_p: torch.Tensor | None  # [B] float32; None when no row uses top-p
    min_p: torch.Tensor | None  # [B] float32; None when no row uses min-p
    # Penalties: None when no row has any.
    repetition_penalty: torch.Tensor | None  # [B, 1] float32
    frequency_penalty: torch.Tensor | None  # [B, 1] float32
    presence_penalty: torch.Tensor | None  # [B, 1] float32
    prompt_mask: torch.Tensor | None  # [B, V] bool: token occurs in the prompt
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output so far
    # (row, token) pairs forced to -inf by min_tokens; None when no row is below its min_tokens.
    min_tokens_rows: torch.Tensor | None
    min_tokens_cols: torch.Tensor | None
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded requests)
    max_num_logprobs: int | None  # largest `logprobs` asked for in the batch; None if none asked
    # (row, token, bias) triples of the rows' logit_bias; None when no row has one.
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_cols: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    # (row, token) pairs that bad_words ban at this step; None when none.
    bad_rows: torch.Tensor | None = None
    bad_cols: torch.Tensor | None = None
    # Rows restricted to allowed_token_ids: the rows, and (position among those rows, token) pairs allowed.
    allowed_rows: torch.Tensor | None = None
    allowed_pos: torch.Tensor | None = None
    allowed_cols: torch.Tensor | None = None

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalty is None

    @staticmethod
    def reads_tokens(params: list[SamplingParams]) -> bool:
        """Whether `build` reads the rows' tokens so far for these params (penalties, min_tokens, bad_words): if
        not, the metadata depends on the params alone and serves later steps of the same rows."""
        return any(p.has_penalties or p.min_tokens or p.bad_words_token_ids for p in params)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: list[torch.Generator | None],
        eos_token_id: int | Collection[int] | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        if not (len(params) == len(prompt_token_ids) == len(output_token_ids) == len(generators)):
            raise ValueError("params, prompt_token_ids, output_token_ids and generators must have one entry per row")
        greedy = [p.greedy for p in params]
        sampling = [p for p, g in zip(params, greedy) if not g]  # the rows top-k, top-p and min-p apply to
        top_k, max_top_k = _top_k(params, greedy, sampling, vocab_size, device)
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=_tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device),
            greedy_mask=_to_device(greedy, torch.bool, device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=_tensor([p.top_p for p in params], device) if any(p.top_p < 1.0 for p in sampling) else None,
            min_p=_tensor([p.min_p for p in params], device) if any(p.min_p > 0.0 for p in sampling) else None,
            **_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device),
            **_min_tokens(params, output_token_ids, eos_token_id, vocab_size, device),
            generators={i: g for i, g in enumerate(generators) if g is not None},
            max_num_logprobs=max(requested) if requested else None,
            **_logit_bias(params, device),
            **_allowed_tokens(params, vocab_size, device),
            **_bad_words(params, output_token_ids, vocab_size, device),
        )


def _tensor(values: list[float], device: torch.device | str) -> torch.Tensor:
    return _to_device(values, torch.float32, device)


def _to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Through pinned memory and a non-blocking copy on CUDA: a plain copy from pageable memory would wait for
    all queued device work, which async scheduling must not."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _top_k(
    params: list[SamplingParams], greedy: list[bool], sampling: list[SamplingParams], vocab_size: int,
    device: torch.device | str
) -> tuple[torch.Tensor | None, int]:
    """`greedy`: each row's; `sampling`: the params of the rows that sample."""
    if not any(0 < p.top_k < vocab_size for p in sampling):
        return None, vocab_size
    ks = [p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size for p, g in zip(params, greedy)]
    return _to_device(ks, torch.int64, device), max(ks)


def _penalties(
    params: list[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> dict[str, torch.Tensor | None]:
    if not any(p.has_penalties for p in params):
        return dict.fromkeys(
            ("repetition_penalty", "frequency_penalty", "presence_penalty", "prompt_mask", "output_counts")
        )
    batch = len(params)
    prompt_rows, prompt_cols = _flatten(prompt_token_ids, vocab_size)
    out_rows, out_cols = _flatten(output_token_ids, vocab_size)
    prompt_mask = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
    prompt_mask[_long(prompt_rows, device), _long(prompt_cols, device)] = True
    output_counts = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
    output_counts.index_put_(
        (_long(out_rows, device), _long(out_cols, device)),
        torch.ones(len(out_rows), dtype=torch.float32, device=device),
        accumulate=True,
    )
    return {
        "repetition_penalty": _tensor([p.repetition_penalty for p in params], device).unsqueeze(1),
        "frequency_penalty": _tensor([p.frequency_penalty for p in params], device).unsqueeze(1),
        "presence_penalty": _tensor([p.presence_penalty for p in params], device).unsqueeze(1),
        "prompt_mask": prompt_mask,
        "output_counts": output_counts,
    }


def _logit_bias(params: list[SamplingParams], device: torch.device | str) -> dict[str, torch.Tensor | None]:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(row)
            cols.append(token)
            values.append(float(bias))
    if not rows:
        return {}
    return {"logit_bias_rows": _long(rows, device), "logit_bias_cols": _long(cols, device),
            "logit_bias_values": _tensor(values, device)}


def _min_tokens(
    params: list[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_id: int | Collection[int] | None,
    vocab_size: int,
    device: torch.device | str,
) -> dict[str, torch.Tensor | None]:
    eos_ids = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
    rows: list[int] = []
    cols: list[int] = []
    for row, p in enumerate(params):
        # Indexing (not zipping) keeps lazily built token lists unbuilt for rows without min_tokens.
        if not p.min_tokens or len(output_token_ids[row]) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned.update(eos_ids)
        for token in sorted(t for t in banned if t < vocab_size):
            rows.append(row)
            cols.append(token)
    if not rows:
        return {"min_tokens_rows": None, "min_tokens_cols": None}
    return {"min_tokens_rows": _long(rows, device), "min_tokens_cols": _long(cols, device)}


def _flatten(token_ids: Sequence[Sequence[int]], vocab_size: int) -> tuple[list[int], list[int]]:
    rows: list[int] = []
    cols: list[int] = []
    for row, ids in enumerate(token_ids):
        valid = [t for t in ids if 0 <= t < vocab_size]
        rows.extend([row] * len(valid))
        cols.extend(valid)
    return rows, cols


def _long(values: list[int], device: torch.device | str) -> torch.Tensor:
    return _to_device(values, torch.int64, device)


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Column 0: the sampled token; columns 1..k: the top-k of the raw distribution. None if no row asked.
    logprob_token_ids: torch.Tensor | None  # [B, k + 1] int64
    logprobs: torch.Tensor | None  # [B, k + 1] float32
    # Rank of the sampled token in the raw distribution (1 = the most likely). None if no row asked.
    sampled_ranks: torch.Tensor | None = None  # [B] int64


def _bad_words(params: list[SamplingParams], output_token_ids: Sequence[Sequence[int]], vocab_size: int,
               device: torch.device | str) -> dict[str, torch.Tensor | None]:
    rows: list[int] = []
    cols: list[int] = []
    for row, p in enumerate(params):
        if not p.bad_words_token_ids:
            continue
        out = output_token_ids[row]
        for seq in p.bad_words_token_ids:
            prefix = seq[:-1]
            if seq[-1] < vocab_size and (not prefix or list(out[len(out) - len(prefix):]) == prefix):
                rows.append(row)
                cols.append(seq[-1])
    if not rows:
        return {}
    return {"bad_rows": _long(rows, device), "bad_cols": _long(cols, device)}


def _allowed_tokens(params: list[SamplingParams], vocab_size: int,
                    device: torch.device | str) -> dict[str, torch.Tensor | None]:
    rows: list[int] = []
    pos: list[int] = []
    cols: list[int] = []
    for row, p in enumerate(params):
        if p.allowed_token_ids is None:
            continue
        for token in p.allowed_token_ids:
            if token < vocab_size:
                pos.append(len(rows))
                cols.append(token)
        rows.append(row)
    if not rows:
        return {}
    return {"allowed_rows": _long(rows, device), "allowed_pos": _long(pos, device), "allowed_cols": _long(cols, device)}


class Sampler:
    """Turns a batch of logits into token ids (and logprobs) without reading device values on the host."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Rows without their own generator draw from this one (torch's default RNG when None).
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        sampled = self._sample(self.transform(logits, meta), meta)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None)
        ids, lps = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, ids, lps, token_ranks(raw_logprobs, lps[:, 0]))

    @staticmethod
    def transform(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The logits every row samples from (greedy too): bias, allowed and banned tokens, penalties,
        min_tokens."""
        logits = apply_logit_bias(logits, meta)
        logits = apply_allowed_tokens(logits, meta)
        logits = apply_bad_words(logits, meta)
        logits = apply_penalties(logits, meta)
        return apply_min_tokens(logits, meta)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy  # type: ignore[return-value]
        probs = sampling_probs(logits, meta)
        random = draw_from_probs(probs, meta.generators, self.generator)
        if greedy is None:
            return random
        return torch.where(meta.greedy_mask, greedy, random)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then frequency and presence over the output."""
    if meta.no_penalties:
        return logits
    seen = meta.prompt_mask | (meta.output_counts > 0)
    penalty = torch.where(seen, meta.repetition_penalty, 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - meta.frequency_penalty * meta.output_counts
    return logits - meta.presence_penalty * (meta.output_counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.logit_bias_rows is None:
        return logits
    return logits.index_put((meta.logit_bias_rows, meta.logit_bias_cols), meta.logit_bias_values.to(logits.dtype),
                            accumulate=True)


def _ban(logits: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None) -> torch.Tensor:
    """-inf at the (row, token) pairs; the logits unchanged (not copied) when there are none."""
    if rows is None:
        return logits
    logits = logits.clone()
    logits[rows, cols] = _NEG_INF
    return logits


def apply_bad_words(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return _ban(logits, meta.bad_rows, meta.bad_cols)


def apply_allowed_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """-inf for every token outside a restricted row's allowed_token_ids."""
    if meta.allowed_rows is None:
        return logits
    banned = torch.ones((meta.allowed_rows.shape[0], logits.shape[-1]), dtype=torch.bool, device=logits.device)
    banned[meta.allowed_pos, meta.allowed_cols] = False
    logits = logits.clone()
    logits[meta.allowed_rows] = logits[meta.allowed_rows].masked_fill(banned, _NEG_INF)
    return logits


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return _ban(logits, meta.min_tokens_rows, meta.min_tokens_cols)


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from: temperature, then min_p, top_k, top_p masks."""
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        logits = apply_top_k(logits, meta.top_k, meta.max_top_k)
    return torch.softmax(logits, dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's k largest logits; a partial top-k of the batch's largest k avoids a full sort."""
    top_values = logits.topk(max_top_k, dim=-1).values
    kth = top_values.gather(1, (top_k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k by rank, then the smallest prefix of the top-k renormalized distribution reaching top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    if top_k is not None:
        sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), _NEG_INF)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # A token is dropped once the tokens ranked above it already reach top_p; rank 0 always stays.
    drop = (mass_before >= top_p.unsqueeze(1)) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def draw_from_probs(
    probs: torch.Tensor, generators: dict[int, torch.Generator], shared: torch.Generator | None
) -> torch.Tensor:
    """One token per row of `probs`, token i with probability p_i. On a GPU an exponential race: argmax(p / q) with
    q ~ Exp(1) (a Gumbel-max in disguise); on the CPU the inverse CDF (`_cpu_inverse_cdf`).

    Rows with their own generator draw from it alone, so a seeded request gets the same tokens
    whatever else is in the batch.
    """
    if probs.device.type == "cpu":
        return _cpu_inverse_cdf(probs, generators, shared)
    q = torch.empty_like(probs).exponential_(generator=shared)
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # Exp(1) can round to 0 in float32; 0/0 would be NaN for masked tokens.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _cpu_inverse_cdf(probs: torch.Tensor, generators: dict[int, torch.Generator],
                     shared: torch.Generator | None) -> torch.Tensor:
    """The CPU's draw from each row of `probs`: the first token whose cumulative probability passes a uniform
    share of the row's total, one uniform per row (a row with its own generator draws it from that alone). The
    exponential race needs one exponential per token, which torch's CPU `exponential_` draws element by element
    (4.2 ms for 32 x 8,192 on one core, half a kestrel-tiny decode step); this takes 0.25 ms. Tokens of
    probability 0 are never chosen (the cumulative sum does not pass anything at them)."""
    u = torch.rand(probs.shape[0], 1, generator=shared, dtype=probs.dtype)
    for row, generator in generators.items():
        u[row] = torch.rand(1, generator=generator, dtype=probs.dtype)
    cdf = probs.cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return chosen.squeeze(1).clamp_max_(probs.shape[-1] - 1)


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column 0: the sampled token and its logprob; then the top `num_logprobs` of the distribution."""
    sampled_ids = sampled.unsqueeze(1)
    sampled_lps = logprobs.gather(1, sampled_ids)
    if num_logprobs == 0:
        return sampled_ids, sampled_lps
    top_lps, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return torch.cat([sampled_ids, top_ids], dim=1), torch.cat([sampled_lps, top_lps], dim=1)


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Rank of each row's chosen logprob within its row: 1 + the number of tokens strictly more likely."""
    return (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1


def logprob_entry(chosen_id: int, chosen_lp: float, chosen_rank: int, top_ids: Sequence[int],
                  top_lps: Sequence[float]) -> dict[int, Logprob]:
    """{token_id: Logprob}: the chosen token first, then the top candidates ranked 1, 2, ..."""
    entry = {chosen_id: Logprob(chosen_lp, chosen_rank)}
    for rank, (token_id, lp) in enumerate(zip(top_ids, top_lps), start=1):
        entry.setdefault(token_id, Logprob(lp, rank))
    return entry


def to_logprob_dicts(out: SamplerOutput, num_logprobs_per_row: list[int | None]) -> list[dict[int, Logprob] | None]:
    """Host-side conversion (syncs once): {token_id: Logprob} with the sampled token first, then its top-n."""
    if out.logprob_token_ids is None or out.logprobs is None:
        return [None] * len(num_logprobs_per_row)
    all_ids = out.logprob_token_ids.tolist()
    all_lps = out.logprobs.tolist()
    all_ranks = out.sampled_ranks.tolist() if out.sampled_ranks is not None else [None] * len(all_ids)
    result: list[dict[int, Logprob] | None] = []
    for ids, lps, rank, n in zip(all_ids, all_lps, all_ranks, num_logprobs_per_row):
        if n is None:
            result.append(None)
            continue
        result.append(logprob_entry(ids[0], lps[0], rank, ids[1: n + 1], lps[1: n + 1]))
    return result
