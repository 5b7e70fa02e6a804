"""Verification of proposed (draft) tokens: the target's k + 1 positions of a request, scored in one forward.

Greedy rows accept the longest prefix of drafts equal to the target's argmax, then take the argmax after it.
Random rows use rejection sampling, which leaves the target distribution exactly as it is: a draft token d
proposed with certainty (n-gram proposals are deterministic: q = one-hot at d) is accepted with probability
p(d); at the first rejection the token is drawn from p with d removed and renormalized (the residual
max(p - q, 0)); when every draft is accepted, one more token is drawn from the last position. p is the
distribution the request would sample from without speculation (temperature, min-p, top-k, top-p, after
logit_bias and allowed_token_ids), so outputs follow the same law. All of it stays on the device; the host
reads the accepted counts and tokens once, when the step is collected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.sample.sampler import Sampler, SamplingMetadata, draw_from_probs, sampling_probs


@dataclass(frozen=True)
class VerifyOutput:
    num_accepted: torch.Tensor  # [R] int64: drafts accepted per request
    tokens: torch.Tensor  # [N] int64: per position, the token emitted if the chain stops there
    # [N] int64: per position, the token the request emits there: its draft while accepted, then `tokens`.
    chosen: torch.Tensor


def verify(logits: torch.Tensor, meta: SamplingMetadata, draft_ids: torch.Tensor, num_drafts: list[int],
           sampler: Sampler) -> VerifyOutput:
    """`logits` [N, V]: the k_r + 1 positions of each request r, concatenated; `meta` has one row per position
    (the request's settings repeated, its generator shared); `draft_ids` [N]: the draft each position checks
    (-1 on each request's last position, which has none)."""
    logits = sampler.transform(logits, meta)
    greedy_ids = logits.argmax(dim=-1)
    has_draft = draft_ids >= 0
    drafts = draft_ids.clamp_min(0)
    if meta.all_greedy:
        accept = has_draft & (drafts == greedy_ids)
        emitted = greedy_ids
    else:
        probs = sampling_probs(logits, meta)
        p_draft = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        uniform = _uniform(probs.shape[0], meta, sampler.generator, probs.device)
        accept_random = has_draft & (uniform < p_draft)
        # The residual: p without the draft (nothing to remove on the last position), renormalized by the race.
        residual = probs.scatter(1, drafts.unsqueeze(1), 0.0).where(has_draft.unsqueeze(1), probs)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
        drawn = draw_from_probs(residual, meta.generators, sampler.generator)
        accept = torch.where(meta.greedy_mask, has_draft & (drafts == greedy_ids), accept_random)
        emitted = torch.where(meta.greedy_mask, greedy_ids, drawn)
    # Per request: the number of leading accepted drafts.
    counts = torch.tensor([k + 1 for k in num_drafts], device=logits.device)
    request_of = torch.repeat_interleave(torch.arange(len(num_drafts), device=logits.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(logits.shape[0], device=logits.device) - starts[request_of]
    rejected_at = torch.where(~accept, position, torch.full_like(position, 1 << 30))
    first_rejection = torch.full((len(num_drafts),), 1 << 30, dtype=torch.long, device=logits.device)
    first_rejection.scatter_reduce_(0, request_of, rejected_at, reduce="amin")
    num_accepted = torch.minimum(first_rejection, counts - 1)
    chosen = torch.where(position < num_accepted[request_of], drafts, emitted)
    return VerifyOutput(num_accepted, emitted, chosen)


def _uniform(rows: int, meta: SamplingMetadata, shared: torch.Generator | None, device: torch.device) -> torch.Tensor:
    u = torch.rand(rows, generator=shared, device=device)
    for row, generator in meta.generators.items():
        u[row] = torch.rand((), generator=generator, device=device)
    return u

