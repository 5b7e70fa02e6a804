"""Draft proposers that run on the worker: a smaller draft model, or an EAGLE-style head over the target's hidden
states. Each keeps its own paged KV cache in the target's blocks: the same block ids and slot mapping index both
caches, and the blocks are sized by the sum of both models' bytes per block.

The invariant that keeps that cache valid: the drafter processes every token the target processes, in the same
step and at the same slots (`catch_up`). Chunked prefill, preemption (recompute rewrites both caches) and prefix
caching (a cached block was computed by both) follow from it. Right after a step's sampling and verification are
enqueued, `propose` enqueues k greedy steps from each row's new last token, read on the device (its sampled or
bonus token, its accepted count), so the drafts reach the host in the step's one copy: it writes its own K/V at
the row's next k positions (the scheduler allocates that lookahead), which the next step's `catch_up` rewrites
with the tokens the target actually processes there. On CUDA the k steps are one graph per batch bucket, and the
catch-up of decode and verify shapes replays graphs too.

An EAGLE head reads, at position p, token t_p and a feature: the target's hidden state at p - 1. Each row keeps
the feature for its next position on the device. A row that starts past position 0 without one (a prefix-cache
hit, a resumed request) reads zeros there: its drafts may be worse, never wrong (verification is lossless).
"""

from __future__ import annotations

import itertools
import time

import torch
from torch import nn

from kestrel.config import EngineConfig, ModelConfig
from kestrel.loader import load_eagle_head, load_model
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker import cuda_graph
from kestrel.worker.cuda_graph import GraphRunner, bucket_for, capture_sizes
from kestrel.worker.input_batch import BlockTable, CachedRequestState, ModelInputs, host_tensor
from kestrel.worker.kv_cache import KVCacheShape, allocate_kv_cache

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class Drafter:
    """What the model runner calls: `catch_up` in each forward, `propose` once the step's sampling is enqueued."""

    def __init__(self, config: EngineConfig, target: nn.Module, dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device) -> None:
        spec = config.speculative
        self.config = config
        self.k = spec.num_speculative_tokens
        self.target = target
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len or 0
        self.model = self._load(config, dtype, device)
        # Its layers use the target's first KV-cache group (its slots and block table).
        self.kv_spec = KVCacheShape.of_layers(self.model.attention_layers(), kv_dtype, self.block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner: GraphRunner | None = None
        self.capture_seconds = 0.0
        self._pin = device.type == "cuda"
        self.proposal_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # per batch bucket
        self.proposal_sizes: list[int] = []
        max_rows = max(config.scheduler.max_num_seqs, 1)
        self._proposal_buffers(max_rows, -(-max(self.max_model_len, 1) // self.block_size))

    def _load(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
        raise NotImplementedError

    def _capture(self, runner: GraphRunner, max_num_seqs: int, verify_batch: int) -> None:
        """Capture the catch-up graphs of `runner` and the k-step proposal graphs; keep their wall time."""
        with torch.inference_mode():
            start = time.perf_counter()
            runner.capture()
            self._capture_proposals(max_num_seqs, verify_batch)
            self.capture_seconds = time.perf_counter() - start
        self.graph_runner = runner

    def bind(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        for layer, cache in zip(self.model.attention_layers(), self.kv_caches, strict=True):
            layer.bind_kv_cache(cache)

    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int, verify_lens: list[int],
                       verify_batch: int) -> None:
        """Graphs of the catch-up in the target's shapes (decode, and verify: `verify_lens` up to `verify_batch`
        rows) and of the k proposal steps."""
        raise NotImplementedError

    def reset_row(self, row: int) -> None:
        """A request took block-table row `row`."""

    def catch_up(self, inputs: ModelInputs, counts: list[int], states: list[CachedRequestState],
                 hidden: torch.Tensor) -> None:
        """Run the drafter over the step's tokens (the target's inputs, at the same slots)."""
        raise NotImplementedError

    def _proposal_buffers(self, max_rows: int, max_blocks_per_seq: int) -> None:
        """Static inputs and outputs of the proposal program (a CUDA graph per batch bucket on GPU): each row's
        first input token, its position, how many steps it may write (0: it only settles), its block table."""
        long = dict(dtype=torch.int64, device=self.device)
        self.first_ids = torch.zeros(max_rows, **long)
        self.first_positions = torch.zeros(max_rows, **long)
        self.step_caps = torch.zeros(max_rows, **long)
        self.table = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32, device=self.device)
        self.query_starts = torch.arange(max_rows + 1, dtype=torch.int32, device=self.device)
        self.drafts = torch.zeros(max_rows, max(self.k, 1), **long)
        self.num_loaded = 0  # rows of the buffers that hold a step's data; the rest is padding (writes nowhere)

    def num_steps(self, first: int) -> int:
        """Drafts a row whose first draft input sits at position `first` may propose (within max_model_len)."""
        return max(min(self.k, self.max_model_len - first - 2), 0)

    def propose(self, tokens: torch.Tensor, token_base: list[int], accepted: torch.Tensor, base: list[int],
                hidden: torch.Tensor, hidden_base: list[int], rows: list[int], caps: list[int],
                block_table: BlockTable) -> torch.Tensor:
        """Enqueue k greedy draft steps for the rows a step sampled, from their new last token, without reading
        anything on the host: `[len(rows), k]` drafts on the device.

        Row i's first input is `tokens[token_base[i] + accepted[i]]` (its sampled or bonus token), at position
        `base[i] + accepted[i]`;
        `hidden[hidden_base[i] + accepted[i]]` is the target's hidden state at the position before it. A row with
        `caps[i] == 0` drafts nothing (its K/V writes go nowhere) but still settles its feature (EAGLE)."""
        n = len(rows)
        bucket = self._bucket(n)
        host = host_tensor(base + hidden_base + rows + caps + token_base, torch.int64, self._pin)
        host = host.to(self.device, non_blocking=True)
        first = host[:n] + accepted
        width = min(-(-(max(base) + 2 * self.k + 1) // self.block_size), self.table.shape[1])
        table = block_table.gather(rows, width)
        self.table[:n, :width].copy_(table.pin_memory() if self._pin else table, non_blocking=True)
        self.first_positions[:n].copy_(first)
        torch.index_select(tokens, 0, host[4 * n:] + accepted, out=self.first_ids[:n])
        self.step_caps[:n].copy_(host[3 * n: 4 * n])
        if self.num_loaded > n:  # rows a larger step loaded: padding again
            self.first_positions[n: self.num_loaded].zero_()
            self.step_caps[n: self.num_loaded].zero_()
            self.table[n: self.num_loaded].zero_()
        self.num_loaded = n
        self._settle(hidden, host[n: 2 * n] + accepted, host[2 * n: 3 * n])
        program = self.proposal_graphs.get(bucket)
        if program is not None:
            program.replay()
        else:
            self._propose_steps(bucket)
        return self.drafts[:n, : self.k]

    def _bucket(self, n: int) -> int:
        return bucket_for(n, self.proposal_sizes) if self.proposal_graphs else n

    def _settle(self, hidden: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Load what the first proposal step reads besides its token (EAGLE: the target's hidden state)."""

    def _propose_steps(self, bucket: int) -> torch.Tensor:
        """The proposal program over the static buffers' first `bucket` rows: k one-token steps, each feeding its
        argmax to the next; device-only, so it is captured as one CUDA graph per bucket."""
        first = self.first_positions[:bucket]
        steps = torch.minimum(self.step_caps[:bucket], self.max_model_len - 2 - first).clamp_(min=0)
        last = (steps - 1).clamp_(min=0)
        table = self.table[:bucket]
        ids = self.first_ids[:bucket]
        carry = self._first_carry(bucket)
        for j in range(self.k):
            # A row past its own steps repeats its last one, writing nowhere; its drafts there are dropped.
            positions = first + last.clamp(max=j)
            column = (positions // self.block_size).clamp_(max=table.shape[1] - 1)
            block = table.gather(1, column.unsqueeze(1)).squeeze(1).to(torch.int64)
            slots = torch.where(steps > j, block * self.block_size + positions % self.block_size, -1)
            meta = AttentionMetadata(slot_mapping=slots, query_start_loc=self.query_starts[: bucket + 1],
                                     seq_lens=(positions + 1).to(torch.int32), block_tables=table,
                                     max_query_len=1, max_seq_len=0)
            hidden, carry = self._step(ids, positions, meta, carry)
            ids = self.target.compute_logits(hidden).argmax(dim=-1)
            self.drafts[:bucket, j].copy_(ids)
        return self.drafts[:bucket]

    def _capture_proposals(self, max_rows: int, verify_batch: int) -> None:
        self.proposal_sizes = capture_sizes(min(max_rows, verify_batch))
        pool = cuda_graph.graph_pool(self.device)
        self.proposal_graphs = {bucket: cuda_graph.capture_graph(lambda b=bucket: self._propose_steps(b), pool)[0]
                                for bucket in reversed(self.proposal_sizes)}

    def _first_carry(self, bucket: int) -> torch.Tensor | None:
        return None

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft step of one token per row: its hidden states (for the target's LM head) and what the next
        step reads besides its token."""
        raise NotImplementedError

    def _longs(self, values: list[int]) -> torch.Tensor:
        """A small int64 index on the device; through pinned memory on CUDA, so the copy does not wait for the
        queued work (async scheduling launches the next step before this one finishes)."""
        return host_tensor(values, torch.int64, self._pin).to(self.device, non_blocking=True)

    def _run(self, forward, inputs: ModelInputs, counts: list[int]) -> torch.Tensor:
        width = inputs.attn_metadata.block_tables.shape[1]
        if self.graph_runner is not None and self.graph_runner.can_run(counts, width):
            return self.graph_runner.run(inputs, counts)
        return forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)


class DraftModelDrafter(Drafter):
    """A smaller causal LM with the target's vocabulary (method 'draft_model')."""

    def _load(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
        draft = ModelConfig(model=config.speculative.model, dtype=_DTYPE_NAMES[dtype],
                             max_model_len=config.model.max_model_len, seed=config.model.seed,
                             load_format="dummy" if config.model.load_format == "dummy" else "auto",
                             generation_config="vllm")
        return load_model(draft, None, device)

    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int, verify_lens: list[int],
                       verify_batch: int) -> None:
        runner = GraphRunner(self.model, max_num_seqs, max_blocks_per_seq, self.device, verify_lens, verify_batch)
        self._capture(runner, max_num_seqs, verify_batch)

    def catch_up(self, inputs: ModelInputs, counts: list[int], states: list[CachedRequestState],
                 hidden: torch.Tensor) -> None:
        self._run(self.model, inputs, counts)

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(ids, positions, meta), None


class EagleDrafter(Drafter):
    """An EAGLE-style head (method 'eagle') on the target's hidden states, sharing its embedding and LM head."""

    def __init__(self, config: EngineConfig, target: nn.Module, dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(config, target, dtype, kv_dtype, device)
        hidden = self.model.hidden_size
        max_rows = max(config.scheduler.max_num_seqs, 1)
        # Per block-table row: the target's hidden state at the row's last kept position (its next feature); one
        # more row takes the writes of a graph's padded rows.
        self.scratch_row = max_rows
        self.features = torch.zeros(max_rows + 1, hidden, dtype=dtype, device=device)
        self.feature_buf = torch.zeros(max_rows, hidden, dtype=dtype, device=device)  # first proposal step's
        self.embed = target.get_input_embeddings()
        # Static inputs of the catch-up graphs besides the GraphBuffers: the target's hidden states in the padded
        # token layout, and per row its block-table row and the padded index of its first token.
        self.catch_hidden: torch.Tensor | None = None
        self.catch_rows = torch.full((2, max_rows), self.scratch_row, dtype=torch.int64, device=device)

    def _load(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
        load_format = "dummy" if config.model.load_format == "dummy" else "auto"
        return load_eagle_head(config.speculative.model, dtype, device, load_format, config.model.seed)

    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int, verify_lens: list[int],
                       verify_batch: int) -> None:
        runner = GraphRunner(self._catch_up_from_buffers, max_num_seqs, max_blocks_per_seq, self.device,
                             verify_lens, verify_batch)
        self.catch_hidden = torch.zeros(runner.buffers.max_tokens, self.features.shape[1], dtype=self.dtype,
                                        device=self.device)
        self.catch_rows = torch.zeros(2, runner.max_batch, dtype=torch.int64, device=self.device)
        self.catch_rows[0].fill_(self.scratch_row)
        self._capture(runner, max_num_seqs, verify_batch)

    def reset_row(self, row: int) -> None:
        self.features[row].zero_()

    def catch_up(self, inputs: ModelInputs, counts: list[int], states: list[CachedRequestState],
                 hidden: torch.Tensor) -> None:
        rows = [s.block_table_row for s in states]
        width = inputs.attn_metadata.block_tables.shape[1]
        if self.graph_runner is not None and self.graph_runner.can_run(counts, width):
            self.graph_runner.run(inputs, counts, lambda index, bucket, q: self._load_catch_up(
                hidden, index, rows, counts, bucket, q))
            return
        # Token i of the step reads the target's hidden state at the position before it: hidden[i - 1] within its
        # row, the row's kept feature for its first token.
        starts = [0, *itertools.accumulate(counts)]
        features = torch.cat([hidden[:1], hidden[:-1]])
        first, row_index = self._longs(starts[:-1]), self._longs(rows)
        features.index_copy_(0, first, self.features.index_select(0, row_index))
        self.model(inputs.input_ids, features, inputs.positions, inputs.attn_metadata, self.embed)
        last = self._longs([end - 1 for end in starts[1:]])
        self.features.index_copy_(0, row_index, hidden.index_select(0, last).to(self.features.dtype))

    def _load_catch_up(self, hidden: torch.Tensor, index: torch.Tensor | None, rows: list[int], counts: list[int],
                       bucket: int, q: int) -> None:
        """Fill the catch-up graph's own static inputs, in the padded layout of GraphBuffers.load."""
        pads = bucket - len(rows)
        host = torch.tensor([rows + [self.scratch_row] * pads,
                             [r * q + q - c for r, c in enumerate(counts)] + [r * q for r in range(len(rows), bucket)]],
                            dtype=torch.int64, pin_memory=self._pin)
        self.catch_rows[:, :bucket].copy_(host, non_blocking=True)
        if index is None:
            self.catch_hidden[: hidden.shape[0]].copy_(hidden)
        else:
            self.catch_hidden.index_copy_(0, index, hidden)

    def _catch_up_from_buffers(self, ids: torch.Tensor, positions: torch.Tensor,
                               meta: AttentionMetadata) -> torch.Tensor:
        """The catch-up graph: every token reads the target's hidden state of the padded token before it, a row's
        first token its kept feature (a pad token's feature and output are never used); then each row keeps the
        target's hidden state at its last token, the end of its padded row."""
        bucket, tokens = meta.seq_lens.shape[0], ids.shape[0]
        q = tokens // bucket
        hidden = self.catch_hidden[:tokens]
        rows, first = self.catch_rows[0, :bucket], self.catch_rows[1, :bucket]
        features = torch.cat([hidden[:1], hidden[:-1]])
        features.index_copy_(0, first, self.features.index_select(0, rows))
        out = self.model(ids, features, positions, meta, self.embed)
        self.features.index_copy_(0, rows, hidden[q - 1:: q])
        return out

    def _settle(self, hidden: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
        # Rows that rejected drafts keep the target's hidden state at their last accepted position.
        features = hidden.index_select(0, index)
        self.features.index_copy_(0, rows, features)
        self.feature_buf[: features.shape[0]].copy_(features)

    def _first_carry(self, bucket: int) -> torch.Tensor | None:
        return self.feature_buf[:bucket]

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.model(ids, carry, positions, meta, self.embed)
        return hidden, hidden  # the head's output feature drives its next step


def build_drafter(config: EngineConfig, target: nn.Module, dtype: torch.dtype, kv_dtype: torch.dtype,
                  device: torch.device) -> Drafter | None:
    spec = config.speculative
    if spec is None or not spec.uses_model:
        return None
    cls = EagleDrafter if spec.method == "eagle" else DraftModelDrafter
    return cls(config, target, dtype, kv_dtype, device)
