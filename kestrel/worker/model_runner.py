"""ModelRunner: loads the model, owns the KV cache and the per-request worker state, runs one step."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kestrel.config import ConfigError, EngineConfig
from kestrel.distributed.parallel import ParallelContext
from kestrel.engine.contracts import GrammarBitmask, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kestrel.kv_spec import KVCacheLayout
from kestrel.loader import load_model
from kestrel.loader.hf_config import resolve_dtype
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.outputs import Logprob
from kestrel.sample.grammar_mask import apply_token_bitmask
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
from kestrel.worker.cuda_graph import GraphRunner, verify_batch_limit
from kestrel.worker.drafter import build_drafter
from kestrel.worker.input_batch import BlockTables, CachedRequestState, build_model_inputs
from kestrel.worker.kv_cache import (
    FP8_E4M3_MAX,
    KVCacheShape,
    allocate_kv_cache,
    bind_layer_caches,
    gpu_kv_cache_budget,
    kv_cache_dtype,
    kv_cache_groups,
    kv_cache_scales,
    num_blocks_for,
)
from kestrel.worker.launch_count import decoder_layer_launches
from kestrel.worker.stage_transport import run_model

logger = logging.getLogger(__name__)


def host_threads_for_gpu_steps() -> None:
    """On a GPU the host's tensors are small (ids, block tables, grammar bitmasks): run torch's CPU ops on one
    thread. With a pool, each op large enough to go parallel left its threads spinning, and they took the cores
    the engine loop and the grammar matchers need (H200 host, batch 64 constrained by a JSON schema: +51% per
    step with 16 threads, +8% with one). Called once the model and KV cache are built, so loading keeps them."""
    if torch.get_num_threads() != 1:
        logger.info("torch CPU threads %d -> 1: the host side of GPU steps is small, and idle pool threads spin",
                    torch.get_num_threads())
        torch.set_num_threads(1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("invalid device='cuda': no CUDA device is available here; use device='cpu' or 'auto'")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, eos_token_id: int | None = None,
                 parallel: ParallelContext | None = None) -> None:
        """`parallel`: this rank's place in a tensor/pipeline-parallel group (kestrel.distributed.worker);
        None runs the whole model in this process."""
        self.config = config
        self.parallel = parallel
        self.device = resolve_device(config.device)
        model_config = config.model
        if self.device.type == "cpu" and model_config.dtype == "auto":
            # Half-precision matmuls are many times slower than float32 on most CPUs.
            model_config = dataclasses.replace(model_config, dtype="float32")
        self.dtype = resolve_dtype(model_config.dtype, model_config.hf_config)
        self.eos_token_id = eos_token_id
        # min_tokens holds back every EOS id: the tokenizer's and generation_config.json's.
        own = frozenset() if eos_token_id is None else frozenset({eos_token_id})
        self.eos_token_ids = own | config.model.generation_defaults.eos_token_ids
        torch.manual_seed(config.model.seed)
        self.model = load_model(model_config, config.quant, self.device, parallel)
        self.vocab_size: int = int(config.model.hf_config["vocab_size"])
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = -(-(config.model.max_model_len or 1) // self.block_size)
        layers = self.model.attention_layers()
        self.kv_spec = KVCacheShape.of_layers(layers, kv_cache_dtype(config.cache, self.dtype), self.block_size)
        # The groups are every stage's; `layer_groups[i]` is the group of this stage's attention layer i.
        self.kv_groups, self.layer_groups = kv_cache_groups(self.kv_spec.layer_specs, parallel)
        self.graph_runner: GraphRunner | None = None
        self.capture_seconds = 0.0
        # A draft model or EAGLE head: loaded before the memory profile, its K/V in the target's blocks.
        self.drafter = build_drafter(config, self.model, self.dtype, self.kv_spec.dtype, self.device)
        draft_bytes = self.drafter.kv_spec.bytes_per_block if self.drafter is not None else 0
        self.num_blocks = num_blocks_for(config, self.kv_spec, self._profiled_kv_budget(), draft_bytes)
        if parallel is not None:  # every rank holds the same blocks: as many as the tightest rank can
            self.num_blocks = parallel.min_over_world(self.num_blocks, self.device)
        # A drafter's K/V lives in group 0's blocks and its layers may read past that group's window.
        self.kv_layout = KVCacheLayout(self.block_size, self.kv_groups, (self.num_blocks,) * len(self.kv_groups),
                                       keep_all_blocks=frozenset({0} if self.drafter is not None else ()))
        self.kv_caches = allocate_kv_cache(self.kv_spec, self.num_blocks, self.device)
        if self.drafter is not None:
            self.drafter.bind(self.num_blocks)
        self.bind_kv_caches(kv_cache_scales(config, layers))
        self.launches_per_layer: int | None = None
        if config.debug_launch_count:
            self.launches_per_layer = self._count_layer_launches()
        if self.device.type == "cuda" and not config.enforce_eager and (parallel is None or parallel.world_size == 1):
            self._capture_graphs()
            if self.drafter is not None:
                self.drafter.capture_graphs(config.scheduler.max_num_seqs, self.max_blocks_per_seq,
                                            *self._verify_shapes())
        generator = torch.Generator(self.device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = BlockTables(config.scheduler.max_num_seqs, self.max_blocks_per_seq,
                                       [group.spec.follows_tokens for group in self.kv_groups])
        self._last_sampled: torch.Tensor | None = None  # sampled ids of the latest launched step, on the device
        if self.device.type == "cuda":
            host_threads_for_gpu_steps()

    # ----- KV cache scales (FP8 cache) -----------------------------------------------------------------

    def bind_kv_caches(self, scales: list[tuple[float, float]]) -> None:
        """Bind each layer's cache with its (k_scale, v_scale) and its KV-cache group."""
        self.kv_scales = list(scales)
        bind_layer_caches(self.model.attention_layers(), self.kv_caches, self.kv_scales, self.layer_groups)
        if self.graph_runner is not None:
            # The scales are kernel arguments baked into the captured graphs.
            self._capture_graphs()

    # ----- GPU memory profiling and CUDA graphs --------------------------------------------------------

    def _profiled_kv_budget(self) -> int | None:
        """On CUDA, the KV budget from a profiling forward pass; None elsewhere or when no profile is needed."""
        cache = self.config.cache
        if self.device.type != "cuda" or cache.num_blocks is not None or cache.kv_cache_memory_bytes is not None:
            return None
        peak = self._profile_peak_memory()
        total = torch.cuda.mem_get_info(self.device)[1]
        budget = gpu_kv_cache_budget(total, peak, cache.gpu_memory_utilization)
        logger.info("memory profile: peak %.2f GiB of %.2f GiB; KV cache budget %.2f GiB at "
                    "gpu_memory_utilization=%.2f", peak / 2**30, total / 2**30, max(budget, 0) / 2**30,
                    cache.gpu_memory_utilization)
        return budget

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Peak bytes of a forward pass over `max_num_batched_tokens` tokens (one prefill sequence) plus the
        logits of `max_num_seqs` rows, with a one-block KV cache that the pass never writes (slot -1)."""
        num_tokens = self.config.scheduler.max_num_batched_tokens
        num_rows = min(num_tokens, self.config.scheduler.max_num_seqs)
        spec = self.kv_spec
        scratch = allocate_kv_cache(spec, 1, self.device)
        bind_layer_caches(self.model.attention_layers(), scratch, None, self.layer_groups)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(1, -(-num_tokens // spec.block_size), dtype=torch.int32, device=self.device),
            max_query_len=num_tokens, max_seq_len=num_tokens,
        ).sharing_group_tables(len(self.kv_groups))
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % max(self.config.model.max_model_len or 1, 1)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = run_model(self.model, self.parallel, ids, positions, meta, transport=False)
        if self.parallel is None or self.parallel.is_last_stage:  # only the last pipeline stage has an LM head
            torch.softmax(self.model.compute_logits(hidden[-num_rows:]), dim=-1)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory outside PyTorch's allocator (CUDA context, cuBLAS workspaces) counts against the budget too.
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) + max(non_torch, 0)
        del hidden, scratch
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    def _count_layer_launches(self) -> int:
        layer = self.model.decoder_layers()[0]
        count = decoder_layer_launches(layer, self.model.hidden_size, self.dtype, self.device)
        kind = "CUDA kernels" if self.device.type == "cuda" else "ATen compute ops (CPU proxy for launches)"
        logger.info("decode step of one decoder layer: %d %s", count, kind)
        return count

    def _verify_shapes(self) -> tuple[list[int], int]:
        """The query lengths and largest batch of the verify-step graphs (the target's and a drafter's catch-up):
        a row scores its last token and up to k drafts, q = 2 .. k + 1 tokens."""
        spec = self.config.speculative
        max_num_seqs = self.config.scheduler.max_num_seqs
        if spec is None:
            return [], verify_batch_limit(max_num_seqs, None)
        return list(range(2, spec.num_speculative_tokens + 2)), verify_batch_limit(max_num_seqs,
                                                                                  spec.disable_by_batch_size)

    def _capture_graphs(self) -> None:
        self.graph_runner = None  # release the previous graphs' pool before capturing new ones
        runner = GraphRunner(self.model, self.config.scheduler.max_num_seqs, self.max_blocks_per_seq, self.device,
                             *self._verify_shapes(), num_groups=len(self.kv_groups))
        with torch.inference_mode():
            self.capture_seconds = runner.capture()
        self.graph_runner = runner

    @torch.inference_mode()
    def calibrate_kv_scales(self, token_ids: list[int] | None = None, num_tokens: int = 512,
                            passes: int = 2) -> list[tuple[float, float]]:
        """FP8 KV scales from a calibration prefill (random token ids unless given): per layer,
        scale = max |K| (resp. |V|) / 448, then rebind. The first pass runs with the current scales, whose
        saturation perturbs later layers; the next pass repeats with the measured ones. Call before serving:
        it writes the first blocks of the cache."""
        if self.kv_spec.dtype != torch.float8_e4m3fn:
            return self.kv_scales
        if token_ids is None:
            g = torch.Generator().manual_seed(self.config.model.seed)
            token_ids = torch.randint(0, self.vocab_size, (num_tokens,), generator=g).tolist()
        n = min(len(token_ids), self.num_blocks * self.block_size, self.config.model.max_model_len or len(token_ids))
        ids = torch.tensor(token_ids[:n], dtype=torch.long, device=self.device)
        num_blocks = -(-n // self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device).unsqueeze(0),
            max_query_len=n, max_seq_len=n,
        ).sharing_group_tables(len(self.kv_groups))
        layers = self.model.attention_layers()
        seen = torch.zeros(len(layers), 2, device=self.device)  # running max |K|, |V| per layer

        def hook(i: int):
            def record(_module, args) -> None:
                seen[i, 0] = torch.maximum(seen[i, 0], args[1].abs().max().float())
                seen[i, 1] = torch.maximum(seen[i, 1], args[2].abs().max().float())
            return record

        for _ in range(passes):
            handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
            try:
                run_model(self.model, self.parallel, ids, torch.arange(n, device=self.device), meta)
            finally:
                for h in handles:
                    h.remove()
            amax = seen.clamp_min(1e-6).tolist()
            self.bind_kv_caches([(k / FP8_E4M3_MAX, v / FP8_E4M3_MAX) for k, v in amax])
        return self.kv_scales

    # ----- per-request state ----------------------------------------------------------------------

    def _add(self, new: NewRequestData) -> None:
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(self.device)
            generator.manual_seed(new.sampling_params.seed)
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=new.sampling_params,
            block_ids=[list(ids) for ids in new.block_ids],
            num_computed_tokens=new.num_computed_tokens,
            generator=generator,
            block_table_row=self.block_table.add(new.block_ids),
        )
        if self.drafter is not None:
            self.drafter.reset_row(self.requests[new.req_id].block_table_row)

    def _apply_scheduler_output(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.block_table.free(state.block_table_row)
        for new in out.new_requests:
            self._add(new)
        for cached in out.cached_requests:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                for ids, added in zip(state.block_ids, cached.new_block_ids, strict=True):
                    ids.extend(added)
                self.block_table.append(state.block_table_row, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            state = self.requests[req_id]
            state.drafts = list(drafts)
            state.token_ids.extend(drafts)  # the step's inputs; replaced by the accepted tokens on collect

    # ----- the step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        return self.collect(self.sample(self.forward(out), grammar))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Enqueue one step on the device and return at once; `collect` waits for its sampled ids.

        A row whose input token was sampled by the step still in flight reads it on the device
        (`last_sampled`), so the next step can be launched before the host knows that token.
        """
        return self.sample(self.forward(out))

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> ForwardStep:
        """Enqueue the step's forward and the logits of its sampling rows; `sample` follows (the engine fills
        the grammar bitmask on the host in between)."""
        self._apply_scheduler_output(out)
        req_ids = list(out.num_scheduled_tokens)
        if not req_ids:
            return ForwardStep(req_ids, [], [], None, {})
        states = [self.requests[rid] for rid in req_ids]
        counts = [out.num_scheduled_tokens[rid] for rid in req_ids]
        inputs = build_model_inputs(states, counts, self.block_size, self.device, self.block_table,
                                    self._last_sampled)
        width = inputs.attn_metadata.block_tables.shape[1]
        if self.graph_runner is not None and self.graph_runner.can_run(counts, width):
            hidden = self.graph_runner.run(inputs, counts)
        else:
            hidden = run_model(self.model, self.parallel, inputs.input_ids, inputs.positions, inputs.attn_metadata)
        draft = None
        if self.drafter is not None:
            self.drafter.catch_up(inputs, counts, states, hidden)
            if out.draft_request_ids:
                draft = DraftStep(out.draft_request_ids, hidden, [0, *itertools.accumulate(counts)])
        prompt_logprobs = self._prompt_logprobs(states, counts, inputs.attn_metadata.query_start_loc, hidden)
        for state, count in zip(states, counts):
            state.num_computed_tokens += count
        if not inputs.sampled_rows:
            return ForwardStep(req_ids, [], [], None, prompt_logprobs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        rows = [states[i] for i in inputs.sampled_rows]
        spec_logits = None
        if any(state.drafts for state in rows):
            # A verifying row also scores the positions of its drafts: the k before its last.
            ends = list(itertools.accumulate(counts))
            positions = [p for i in inputs.sampled_rows if states[i].drafts
                         for p in range(ends[i] - 1 - len(states[i].drafts), ends[i] - 1)]
            index = _to_device(torch.tensor(positions, dtype=torch.long), self.device)
            spec_logits = self.model.compute_logits(hidden[index])
        return ForwardStep(req_ids, inputs.sampled_rows, rows, logits, prompt_logprobs, spec_logits, draft)

    @torch.inference_mode()
    def forward_stage(self, out: SchedulerOutput) -> None:
        """A pipeline stage before the last: run this stage's layers on the step and hand its hidden states on
        (`run_model` sends them). Only the last stage samples; `record_sampled` brings its ids here before
        any later step reads them."""
        self._apply_scheduler_output(out)
        states = [self.requests[rid] for rid in out.num_scheduled_tokens]
        if not states:
            return
        counts = list(out.num_scheduled_tokens.values())
        inputs = build_model_inputs(states, counts, self.block_size, self.device, self.block_table)
        run_model(self.model, self.parallel, inputs.input_ids, inputs.positions, inputs.attn_metadata)
        for state, count in zip(states, counts):
            state.num_computed_tokens += count

    def record_sampled(self, req_ids: list[str], sampled_token_ids: list[list[int]]) -> None:
        """The tokens the last stage added to each request in a step (a pipeline stage before the last); requests
        released meanwhile are skipped."""
        for req_id, tokens in zip(req_ids, sampled_token_ids, strict=True):
            state = self.requests.get(req_id)
            if state is None:
                continue
            if state.drafts:  # a verify step: its drafts were this stage's inputs; the accepted ones come back
                del state.token_ids[len(state.token_ids) - len(state.drafts):]
                state.drafts = []
            state.token_ids.extend(tokens)

    @torch.inference_mode()
    def sample(self, step: ForwardStep, grammar: GrammarBitmask | None = None) -> LaunchedStep:
        """Enqueue the sampling of a forwarded step, its constrained rows masked by `grammar` first (so greedy,
        top-p/top-k and logprobs all see the masked distribution)."""
        launched = self._sample(step, grammar)
        if step.draft is not None:
            self._propose(step.draft, launched)
        self._copy_to_host(launched)
        return launched

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
            [s.block_table_row for s in states], caps, self.block_table[0])
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
        meta = SamplingMetadata.build(
            [s.sampling_params for s in rows],
            _TokenLists(rows, prompt=True),
            _TokenLists(rows, prompt=False),
            [s.generator for s in rows],
            self.eos_token_ids,
            logits.shape[-1],
            self.device,
        )
        result = self.sampler(logits, meta)
        for i, state in enumerate(rows):
            state.num_pending += 1
            state.pending_row = i
        self._last_sampled = result.sampled_token_ids
        return LaunchedStep(step.req_ids, step.sampled_rows, rows, result, step.prompt_logprobs)

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
        verified = verify(logits, meta, _to_device(draft_ids, self.device), [len(s.drafts) for s in states],
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
        self._last_sampled = None
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
        masks = _to_device(grammar.bitmask if every_row else grammar.bitmask[mask_rows], self.device)
        return apply_token_bitmask(logits, masks, _to_device(torch.tensor(targets, dtype=torch.long), self.device))

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
        return ModelRunnerOutput(step.req_ids, sampled, logprobs, step.prompt_logprobs, drafts)

    def _prompt_logprobs(self, states: list[CachedRequestState], counts: list[int], query_start_loc: torch.Tensor,
                         hidden: torch.Tensor) -> dict[str, list[dict[int, Logprob] | None]]:
        """Logprobs of each prompt token given the ones before it, for the prompt rows of this step.

        Row p of a chunk predicts token p + 1; the first prompt token has no logprob (None).
        """
        result: dict[str, list[dict[int, Logprob] | None]] = {}
        starts = None
        for row, (state, count) in enumerate(zip(states, counts)):
            k = state.sampling_params.prompt_logprobs
            first = state.num_computed_tokens
            last = min(first + count, state.num_prompt_tokens - 1)  # exclusive: positions with a next prompt token
            if k is None or first >= state.num_prompt_tokens:
                continue
            if starts is None:
                starts = query_start_loc.tolist()
            entries: list[dict[int, Logprob] | None] = [None] if first == 0 else []
            if last > first:
                rows = hidden[starts[row]: starts[row] + (last - first)]
                logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
                targets = torch.tensor(state.token_ids[first + 1: last + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
                ranks = token_ranks(logprobs, chosen).tolist()
                top_lp, top_ids = logprobs.topk(k, dim=-1)
                top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
                for i, (token_id, lp) in enumerate(zip(targets.tolist(), chosen.tolist())):
                    entries.append(logprob_entry(token_id, lp, ranks[i], top_ids[i], top_lp[i]))
            result[state.req_id] = entries
        return result


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


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


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
