"""A step's sampling on the worker: the logits of its sampling rows (and of the drafts it verifies), grammar masks,
sampling or verification of drafts, the worker-side drafter's proposals, logprobs and prompt logprobs, and the one
host copy of every id the engine reads, collected into a `ModelRunnerOutput` (every `expert_load_interval` steps
with the expert-load counts in the same copy).

Nothing here waits for the device until `collect`: the sampled ids stay on the device (a step launched before they
reach the host reads them there), and every id the host needs travels in one pinned copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kestrel import ops
from kestrel.engine.contracts import GrammarBitmask, ModelRunnerOutput
from kestrel.model.expert_load import ExpertLoad
from kestrel.outputs import Logprob
from kestrel.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    gather_logprobs,
    logprob_entry,
    to_logprob_dicts,
    token_ranks,
)
from kestrel.sample.spec_verify import VerifyOutput, verify
from kestrel.worker.drafter import Drafter
from kestrel.worker.input_batch import CachedRequestState
from kestrel.worker.step_inputs import ScheduledStep, StepInputs


@dataclass
class ForwardStep:
    """A step whose forward is enqueued; its sampling is not yet."""

    req_ids: list[str]
    sampled_rows: list[int]
    rows: list[CachedRequestState]
    logits: torch.Tensor | None  # [len(rows), vocab]; None when no row samples
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]]
    # The positions of the verifying rows' drafts, k per such row in row order; None without drafts.
    spec_logits: torch.Tensor | None = None
    draft: DraftStep | None = None
    pooled: Pooled | None = None


@dataclass
class Pooled:
    """The pooled final hidden states of the pooling requests whose prompt a step completed, on the device."""

    req_ids: list[str]
    vectors: torch.Tensor  # float32, the requests' vectors one after the other
    sizes: list[int]


@dataclass
class DraftStep:
    """What a worker-side drafter needs when the step samples: the requests to propose for, the target's hidden
    states of the step (valid until the next forward) and each row's first token among them."""

    request_ids: frozenset[str]
    hidden: torch.Tensor
    starts: list[int]


@dataclass
class SpecStep:
    """The verifying rows of a launched step."""

    batch_rows: list[int]
    states: list[CachedRequestState]
    verified: VerifyOutput
    logprobs: SamplerOutput | None = None  # per verified position, when a verifying row asked for logprobs


@dataclass
class LaunchedStep:
    """A step enqueued on the device, waiting to be collected."""

    req_ids: list[str]
    sampled_rows: list[int]  # batch rows that sample, in the order of `rows`
    rows: list[CachedRequestState]
    result: SamplerOutput | None
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]]
    spec: SpecStep | None = None
    proposal: Proposal | None = None
    # Every id the host reads, packed by `_copy_to_host` (pinned on CUDA, the device tensor on the CPU).
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None  # recorded after that copy on CUDA
    pooled: Pooled | None = None
    expert_load: bool = False  # `host` ends with the expert-load counts


@dataclass
class Proposal:
    """The drafter's proposals of a launched step: `drafts[i]` for proposal row i (plain sampled rows, then the
    verifying ones); `req_ids[j]` proposes from row `rows[j]`, whose first draft input sits at position
    `base[rows[j]]` plus its accepted count."""

    drafts: torch.Tensor  # [rows, k] int64, on the device
    req_ids: list[str]
    base: list[int]
    rows: list[int]
    num_plain: int


PROMPT_LOGPROB_PIECE_ELEMENTS = 1 << 27  # logits scored at once (512 MiB of float32): bounds a long prompt's memory


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class StepSampler:
    """Scores, samples and collects the steps of one model runner."""

    def __init__(self, model: nn.Module, sampler: Sampler, eos_token_ids: frozenset[int], device: torch.device,
                 drafter: Drafter | None, inputs: StepInputs, expert_load: ExpertLoad | None = None,
                 expert_load_interval: int = 1) -> None:
        self.model = model
        self.expert_load = expert_load
        self.expert_load_interval = expert_load_interval
        self._steps = 0  # steps sampled, which pace the expert-load reports
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.drafter = drafter
        self.inputs = inputs
        # (row ids, vocabulary size, rows, metadata) of the last step whose metadata depends on params alone.
        self._cached_metadata: tuple[list[int], int, list[CachedRequestState], SamplingMetadata] | None = None

    # ----- after the forward ---------------------------------------------------------------------------

    def score(self, step: ScheduledStep, hidden: torch.Tensor, draft: DraftStep | None) -> ForwardStep:
        """The step's prompt logprobs and the logits of its sampling rows (a verifying row's drafts too), before
        its requests' computed counts advance."""
        states, counts, inputs = step.states, step.counts, step.inputs
        prompt_logprobs = self._prompt_logprobs(states, counts, inputs.attn_metadata.query_start_loc, hidden)
        _gather_pooled_prompt(states, counts, hidden)
        if not inputs.sampled_rows:
            return ForwardStep(step.req_ids, [], [], None, prompt_logprobs)
        last = hidden[inputs.logits_indices]
        logits = self.model.compute_logits(last)
        rows = [states[i] for i in inputs.sampled_rows]
        spec_logits = None
        if any(state.drafts for state in rows):
            # A verifying row also scores the positions of its drafts: the k before its last.
            ends = list(itertools.accumulate(counts))
            positions = [p for i in inputs.sampled_rows if states[i].drafts
                         for p in range(ends[i] - 1 - len(states[i].drafts), ends[i] - 1)]
            index = to_device(torch.tensor(positions, dtype=torch.long), self.device)
            spec_logits = self.model.compute_logits(hidden[index])
        return ForwardStep(step.req_ids, inputs.sampled_rows, rows, logits, prompt_logprobs, spec_logits, draft,
                           _pool(rows, last, self.model))

    def _prompt_logprobs(self, states: list[CachedRequestState], counts: list[int], query_start_loc: torch.Tensor,
                         hidden: torch.Tensor) -> dict[str, list[dict[int, Logprob] | None]]:
        """Logprobs of each prompt token given the ones before it, for the prompt rows of this step.

        Row p of a chunk predicts token p + 1; the first prompt token has no logprob (None). Every request's rows
        are scored in one batch: one logits GEMM, one log-softmax, one host copy per step.
        """
        result: dict[str, list[dict[int, Logprob] | None]] = {}
        starts = None
        spans: list[tuple[str, int, int, int]] = []  # request id, first hidden row, rows, top-k
        targets: list[int] = []
        for row, (state, count) in enumerate(zip(states, counts)):
            k = state.sampling_params.prompt_logprobs
            first = state.num_computed_tokens
            if state.num_dropped_tokens:  # a stream: past its sink blocks, cache positions skip the dropped tokens
                if first < state.sink_end:
                    continue  # recomputing a preempted stream's cache: the dropped tokens' logprobs are gone
                first += state.num_dropped_tokens
            last = min(first + count, state.num_prompt_tokens - 1)  # exclusive: positions with a next prompt token
            if k is None or first >= state.num_prompt_tokens:
                continue
            if starts is None:
                starts = query_start_loc.tolist()
            result[state.req_id] = [None] if first == 0 else []
            if last > first:
                spans.append((state.req_id, starts[row], last - first, k))
                targets.extend(state.token_ids[first + 1: last + 1])
        if not spans:
            return result
        index = to_device(torch.cat([torch.arange(start, start + rows) for _, start, rows, _ in spans]), self.device)
        target_ids = to_device(torch.tensor(targets, dtype=torch.long), self.device)
        top_k = max(k for *_, k in spans)
        pieces = []
        begin, rows_per_piece = 0, 1024
        while begin < len(targets):
            end = begin + rows_per_piece
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[index[begin:end]]), dim=-1)
            chosen = logprobs.gather(1, target_ids[begin:end, None])
            top_lp, top_ids = logprobs.topk(top_k, dim=-1)
            ranks = token_ranks(logprobs, chosen.squeeze(1))[:, None]
            pieces.append(torch.cat([chosen.double(), ranks.double(), top_lp.double(), top_ids.double()], dim=1))
            begin, rows_per_piece = end, max(1, PROMPT_LOGPROB_PIECE_ELEMENTS // logprobs.shape[1])
        host = torch.cat(pieces).cpu().tolist()
        at = 0
        for req_id, _, rows, k in spans:
            entries = result[req_id]
            if k == 0:  # the chosen token alone (a scorer's request): no candidates to merge in
                entries.extend({token_id: Logprob(row[0], int(row[1]))}
                               for token_id, row in zip(targets[at: at + rows], host[at: at + rows]))
                at += rows
                continue
            for i in range(at, at + rows):
                lp, rank, *top = host[i]
                entries.append(logprob_entry(targets[i], lp, int(rank), [int(t) for t in top[top_k: top_k + k]],
                                             top[:k]))
            at += rows
        return result

    # ----- sampling -----------------------------------------------------------------------------------

    def sample(self, step: ForwardStep, grammar: GrammarBitmask | None = None) -> LaunchedStep:
        """Enqueue the sampling of a forwarded step, its constrained rows masked by `grammar` first (so greedy,
        top-p/top-k and logprobs all see the masked distribution), the drafter's proposals and the host copy."""
        launched = self._sample(step, grammar)
        launched.pooled = step.pooled
        if step.draft is not None:
            self._propose(step.draft, launched)
        self._copy_to_host(launched)
        return launched

    def _sample(self, step: ForwardStep, grammar: GrammarBitmask | None) -> LaunchedStep:
        if step.logits is None:
            return LaunchedStep(step.req_ids, [], [], None, step.prompt_logprobs)
        if step.spec_logits is not None:
            return self._sample_with_drafts(step, grammar)
        logits, rows = step.logits, step.rows
        if grammar is not None and grammar.req_ids:
            position = {state.req_id: i for i, state in enumerate(rows)}
            pairs = [(i, position[rid]) for i, rid in enumerate(grammar.req_ids) if rid in position]
            logits = self._apply_grammar(logits, grammar, [i for i, _ in pairs], [row for _, row in pairs])
        result = self.sampler(logits, self._metadata(rows, logits.shape[-1]))
        for i, state in enumerate(rows):
            state.num_pending += 1
            state.pending_row = i
        self.inputs.last_sampled = result.sampled_token_ids
        return LaunchedStep(step.req_ids, step.sampled_rows, rows, result, step.prompt_logprobs)

    def _metadata(self, rows: list[CachedRequestState], vocab_size: int) -> SamplingMetadata:
        """The sampling metadata of a step's rows. A step of the same requests, in the same order, as the last one
        built reuses its metadata where that depends on their params alone (no penalties, min_tokens or bad_words,
        which read the tokens so far): a decode batch that does not change pays for it once, not every step."""
        key = list(map(id, rows))
        cached = self._cached_metadata
        if cached is not None and cached[0] == key and cached[1] == vocab_size:
            return cached[3]
        params = [s.sampling_params for s in rows]
        meta = SamplingMetadata.build(params, _TokenLists(rows, prompt=True), _TokenLists(rows, prompt=False),
                                      [s.generator for s in rows], self.eos_token_ids, vocab_size, self.device)
        # The rows are kept with the key so that no other object can take one of their ids while it is cached.
        self._cached_metadata = None if SamplingMetadata.reads_tokens(params) else (key, vocab_size, rows, meta)
        return meta

    def _sample_with_drafts(self, step: ForwardStep, grammar: GrammarBitmask | None) -> LaunchedStep:
        """A step with verifying rows: the others sample as usual, the verifying ones check their drafts
        (speculative decoding runs synchronously, so nothing reads `last_sampled`)."""
        plain = [i for i, state in enumerate(step.rows) if not state.drafts]
        verifying = [i for i, state in enumerate(step.rows) if state.drafts]
        launched = self._sample(ForwardStep(step.req_ids, [step.sampled_rows[i] for i in plain],
                                           [step.rows[i] for i in plain],
                                           step.logits[plain] if plain else None, step.prompt_logprobs), grammar)
        states = [step.rows[i] for i in verifying]
        pieces, offset = [], 0
        for i, state in zip(verifying, states):
            k = len(state.drafts)
            pieces += [step.spec_logits[offset: offset + k], step.logits[i: i + 1]]
            offset += k
        repeat = [s for s in states for _ in range(len(s.drafts) + 1)]
        meta = SamplingMetadata.build([s.sampling_params for s in repeat], _TokenLists(repeat, prompt=True),
                                      _DraftOutputs(states), [s.generator for s in repeat],
                                      self.eos_token_ids, step.logits.shape[-1], self.device)
        draft_ids = torch.tensor([t for s in states for t in (*s.drafts, -1)], dtype=torch.long)
        logits = torch.cat(pieces)
        if grammar is not None and grammar.req_ids:
            logits = self._mask_verified_positions(logits, states, grammar)
        verified = verify(logits, meta, to_device(draft_ids, self.device), [len(s.drafts) for s in states],
                          self.sampler)
        logprobs = None
        if meta.max_num_logprobs is not None:
            # As without speculation: the raw (pre-transform) distribution at each position, its emitted token
            # first; the host keeps the accepted positions' entries.
            raw = torch.log_softmax(logits, dim=-1)
            ids, lps = gather_logprobs(raw, verified.chosen, meta.max_num_logprobs)
            logprobs = SamplerOutput(verified.chosen, ids, lps, token_ranks(raw, lps[:, 0]))
        for state in states:
            state.num_pending += 1
        launched.spec = SpecStep([step.sampled_rows[i] for i in verifying], states, verified, logprobs)
        self.inputs.last_sampled = None
        return launched

    def _mask_verified_positions(self, logits: torch.Tensor, states: list[CachedRequestState],
                                 grammar: GrammarBitmask) -> torch.Tensor:
        """A constrained verifying request has one bitmask row per verified position, in order."""
        first: dict[str, int] = {}
        for i, rid in enumerate(grammar.req_ids):
            first.setdefault(rid, i)
        mask_rows, targets, offset = [], [], 0
        for state in states:
            k = len(state.drafts)
            start = first.get(state.req_id)
            if start is not None:
                mask_rows += range(start, start + k + 1)
                targets += range(offset, offset + k + 1)
            offset += k + 1
        return self._apply_grammar(logits, grammar, mask_rows, targets)

    def _apply_grammar(self, logits: torch.Tensor, grammar: GrammarBitmask, mask_rows: list[int],
                       targets: list[int]) -> torch.Tensor:
        """Mask logits row targets[i] by the grammar's row mask_rows[i]."""
        if not mask_rows:
            return logits
        every_row = mask_rows == list(range(grammar.bitmask.shape[0]))
        # The usual step masks with every row in order: the (pinned) mask goes to the device without a gather.
        masks = to_device(grammar.bitmask if every_row else grammar.bitmask[mask_rows], self.device)
        return ops.apply_token_bitmask(logits, masks, to_device(torch.tensor(targets, dtype=torch.long), self.device))

    def _propose(self, draft: DraftStep, launched: LaunchedStep) -> None:
        """Enqueue the drafter's proposals from the step's sampled rows (plain rows, then verifying ones), fed on
        the device by their sampled token and accepted count: nothing waits for the host."""
        spec = launched.spec
        plain = launched.rows
        verifying = spec.states if spec is not None else []
        batch_rows = launched.sampled_rows + (spec.batch_rows if spec is not None else [])
        states = plain + verifying
        if not states:
            return
        sampled = launched.result.sampled_token_ids if plain else None
        sources, accepted = [], []
        if plain:
            sources.append(sampled)
            accepted.append(torch.zeros(len(plain), dtype=torch.int64, device=self.device))
        if spec is not None:
            sources.append(spec.verified.tokens)
            accepted.append(spec.verified.num_accepted)
        token_base, offset = list(range(len(plain))), len(plain)
        for state in verifying:
            token_base.append(offset)
            offset += len(state.drafts) + 1
        # A verifying row's first draft input is its bonus token, at its position before the drafts plus the
        # accepted ones; the target's hidden state just before it sits at the same offset among its step tokens.
        base = [len(s.token_ids) - len(s.drafts) for s in states]
        hidden_base = [draft.starts[r + 1] - 1 - len(s.drafts) for r, s in zip(batch_rows, states)]
        caps = [self.drafter.k if s.req_id in draft.request_ids else 0 for s in states]
        drafts = self.drafter.propose(
            sources[0] if len(sources) == 1 else torch.cat(sources), token_base,
            accepted[0] if len(accepted) == 1 else torch.cat(accepted), base, draft.hidden, hidden_base,
            [s.block_table_row for s in states], caps, self.inputs.block_table[0])
        launched.proposal = Proposal(drafts, [s.req_id for s, cap in zip(states, caps) if cap], base,
                                     [i for i, cap in enumerate(caps) if cap], len(plain))

    def _copy_to_host(self, launched: LaunchedStep) -> None:
        """Every id the host reads of the step in one copy: the sampled ids, the verified tokens and accepted
        counts, the drafts; `collect` waits once for it."""
        pieces = []
        if launched.rows:
            pieces.append(launched.result.sampled_token_ids)
        if launched.spec is not None:
            pieces += [launched.spec.verified.tokens, launched.spec.verified.num_accepted]
        if launched.proposal is not None:
            pieces.append(launched.proposal.drafts.reshape(-1))
        if self.expert_load is not None:
            self._steps += 1
            if self._steps % self.expert_load_interval == 1 % self.expert_load_interval:
                # A copy: the live counts keep growing with the steps enqueued before this one is collected.
                pieces.append(self.expert_load.counts.reshape(-1).clone())
                launched.expert_load = True
        if not pieces:
            return
        packed = pieces[0] if len(pieces) == 1 else torch.cat([p.to(torch.int64) for p in pieces])
        if self.device.type != "cuda":
            launched.host = packed
            return
        launched.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        launched.host.copy_(packed, non_blocking=True)
        launched.event = torch.cuda.Event()
        launched.event.record()

    # ----- collect ------------------------------------------------------------------------------------

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's ids (the step's one host synchronization) and record them."""
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: list[list[dict[int, Logprob]] | None] = [None] * len(step.req_ids)
        if step.event is not None:
            step.event.synchronize()
        values = step.host.tolist() if step.host is not None else []
        offset = len(step.rows)
        if step.rows:
            row_logprobs = to_logprob_dicts(step.result, [s.sampling_params.logprobs for s in step.rows])
            for row, state, token_id, lp in zip(step.sampled_rows, step.rows, values, row_logprobs):
                state.num_pending -= 1
                state.token_ids.append(token_id)
                sampled[row] = [token_id]
                logprobs[row] = None if lp is None else [lp]
        accepted: list[int] = []
        if step.spec is not None:
            spec = step.spec
            num_positions = sum(len(s.drafts) + 1 for s in spec.states)
            emitted = values[offset: offset + num_positions]
            accepted = values[offset + num_positions: offset + num_positions + len(spec.states)]
            offset += num_positions + len(spec.states)
            position_logprobs = [None] * len(emitted)
            if spec.logprobs is not None:
                per_position = [s.sampling_params.logprobs for s in spec.states for _ in range(len(s.drafts) + 1)]
                position_logprobs = to_logprob_dicts(spec.logprobs, per_position)
            start = 0
            for row, state, num_accepted in zip(spec.batch_rows, spec.states, accepted):
                k = len(state.drafts)
                tokens = state.drafts[:num_accepted] + [emitted[start + num_accepted]]
                if state.sampling_params.logprobs is not None:
                    logprobs[row] = position_logprobs[start: start + num_accepted + 1]
                start += k + 1
                del state.token_ids[len(state.token_ids) - k:]
                state.token_ids.extend(tokens)
                state.drafts = []
                state.num_pending -= 1
                sampled[row] = tokens
        drafts: dict[str, list[int]] = {}
        proposal = step.proposal
        if proposal is not None:
            k = self.drafter.k
            for req_id, i in zip(proposal.req_ids, proposal.rows):
                num_accepted = accepted[i - proposal.num_plain] if i >= proposal.num_plain else 0
                row = values[offset + i * k: offset + (i + 1) * k]
                drafts[req_id] = row[: self.drafter.num_steps(proposal.base[i] + num_accepted)]
        pooled = {}
        if step.pooled is not None:
            flat = step.pooled.vectors.cpu().tolist()
            starts = [0, *itertools.accumulate(step.pooled.sizes)]
            pooled = {rid: flat[a:b] for rid, a, b in zip(step.pooled.req_ids, starts, starts[1:])}
        expert_load = None
        if step.expert_load:
            expert_load = self.expert_load.to_dict(values[len(values) - self.expert_load.counts.numel():])
        return ModelRunnerOutput(step.req_ids, sampled, logprobs, step.prompt_logprobs, drafts, pooled,
                                 expert_load)


def _gather_pooled_prompt(states: list[CachedRequestState], counts: list[int], hidden: torch.Tensor) -> None:
    """MEAN and CLS pooling read more than the last position: each step adds its prompt rows' hidden states to
    the request's running sum (MEAN), or keeps its first token's (CLS), so chunked prefill pools the whole prompt.
    Such a request never starts from a cached prefix (`PoolingParams.needs_every_token`)."""
    start = 0
    for state, count in zip(states, counts):
        params = state.pooling_params
        first = state.num_computed_tokens
        in_prompt = min(count, state.num_prompt_tokens - first)
        if params is not None and params.needs_every_token and in_prompt > 0:
            if params.pooling_type == "MEAN":
                chunk = hidden[start: start + in_prompt].float().sum(dim=0)
                partial = state.pooled_partial
                state.pooled_partial = chunk if first == 0 or partial is None else partial + chunk
            elif first == 0:
                state.pooled_partial = hidden[start].float()
        start += count


def _pool(rows: list[CachedRequestState], last: torch.Tensor, model: nn.Module) -> Pooled | None:
    """The pooled vectors of the pooling requests among a step's sampling rows: a pooling request samples once,
    at its prompt's last position, the step its prompt completes; the model's hidden states come after its final
    norm. LAST pools that row, MEAN and CLS what `_gather_pooled_prompt` kept; the model's pooler head (a
    classifier's labels, else the vector itself) follows, then Matryoshka truncation and normalization."""
    pooled, req_ids, kept = [], [], []
    for i, state in enumerate(rows):
        params = state.pooling_params
        if params is None:
            continue
        if params.pooling_type == "LAST":
            pooled.append(last[i].float())
        elif params.pooling_type == "MEAN":
            pooled.append(state.pooled_partial / state.num_prompt_tokens)
        else:
            pooled.append(state.pooled_partial)
        state.pooled_partial = None
        req_ids.append(state.req_id)
        kept.append(params)
    if not pooled:
        return None
    heads = model.pooler_head(torch.stack(pooled))
    vectors = []
    for head, params in zip(heads, kept):
        vector = head[: params.dimensions].float()
        vectors.append(torch.nn.functional.normalize(vector, dim=-1) if params.normalize else vector)
    return Pooled(req_ids, torch.cat(vectors), [v.numel() for v in vectors])


class _DraftOutputs(Sequence[list[int]]):
    """The output token ids before each verified position: position j of a request with k drafts follows its
    output before the drafts plus drafts 1..j, so penalties, min_tokens and bad words see what would precede
    that token without speculation. Sliced only when the sampler asks for a row."""

    def __init__(self, states: list[CachedRequestState]) -> None:
        self.rows = [(state, j) for state in states for j in range(len(state.drafts) + 1)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, row):  # type: ignore[override]
        if isinstance(row, slice):
            return [self[i] for i in range(*row.indices(len(self)))]
        state, j = self.rows[row]
        output = state.output_token_ids  # the drafts are at its end while the step runs
        return output[: len(output) - len(state.drafts) + j]


class _TokenLists(Sequence[list[int]]):
    """Each row's prompt (or output) token ids, sliced only when the sampler asks for that row: most steps
    need none (no penalties, no min_tokens), and slicing every row's history costs O(context) per row."""

    def __init__(self, states: list[CachedRequestState], prompt: bool) -> None:
        self.states = states
        self.prompt = prompt

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, row):  # type: ignore[override]
        if isinstance(row, slice):
            return [self[i] for i in range(*row.indices(len(self)))]
        state = self.states[row]
        return state.prompt_token_ids if self.prompt else state.output_token_ids
