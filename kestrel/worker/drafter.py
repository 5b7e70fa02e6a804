"""Draft proposers that run on the worker: a smaller draft model, or an EAGLE-style head over the target's hidden
states. Each keeps its own paged KV cache in the target's blocks: the same block ids and slot mapping index both
caches, and the blocks are sized by the sum of both models' bytes per block.

The invariant that keeps that cache valid: the drafter processes every token the target processes, in the same
step and at the same slots (`catch_up`). Chunked prefill, preemption (recompute rewrites both caches) and prefix
caching (a cached block was computed by both) follow from it. After a step whose tokens are known (speculation
runs synchronously), `propose` runs k greedy steps from each row's last token: it writes its own K/V at the row's
next k positions (the scheduler allocates that lookahead), which the next step's `catch_up` rewrites with the
tokens the target actually processes there.

An EAGLE head reads, at position p, token t_p and a feature: the target's hidden state at p - 1. Each row keeps
the feature for its next position on the device. A row that starts past position 0 without one (a prefix-cache
hit, a resumed request) reads zeros there: its drafts may be worse, never wrong (verification is lossless).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from kestrel.config import EngineConfig, ModelConfig
from kestrel.loader import load_eagle_head, load_model
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.cuda_graph import GraphRunner, verify_batch_limit
from kestrel.worker.input_batch import BlockTable, CachedRequestState, ModelInputs
from kestrel.worker.kv_cache import KVCacheSpec, allocate_kv_cache

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class Drafter:
    """What the model runner calls: `catch_up` in each forward, `settle` and `propose` when a step is collected."""

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
        num_layers, num_kv_heads, head_size = self.model.kv_cache_spec()
        self.kv_spec = KVCacheSpec(num_layers, num_kv_heads, head_size, kv_dtype, self.block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner: GraphRunner | None = None
        self.capture_seconds = 0.0

    def _load(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
        raise NotImplementedError

    def bind(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        for layer, cache in zip(self.model.attention_layers(), self.kv_caches, strict=True):
            layer.bind_kv_cache(cache)

    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        raise NotImplementedError

    def reset_row(self, row: int) -> None:
        """A request took block-table row `row`."""

    def catch_up(self, inputs: ModelInputs, counts: list[int], states: list[CachedRequestState],
                 hidden: torch.Tensor) -> None:
        """Run the drafter over the step's tokens (the target's inputs, at the same slots)."""
        raise NotImplementedError

    def settle(self, rows: list[int], hidden_index: list[int], hidden: torch.Tensor) -> None:
        """Rows whose last kept position changed at collect (rejected drafts): `hidden[hidden_index[i]]` is the
        target's hidden state at the last position block-table row `rows[i]` keeps."""

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], block_table: BlockTable) -> list[list[int]]:
        """Up to k greedy drafts per request, from its last (known, not yet computed) token."""
        if not states:
            return []
        rows = len(states)
        first = [len(s.token_ids) - 1 for s in states]  # the position of each row's last token
        steps = [max(min(self.k, self.max_model_len - p - 2), 0) for p in first]
        positions, slots, seq_lens = [], [], []
        for j in range(self.k):
            for state, p, n in zip(states, first, steps):
                # A row past its own steps repeats its last one, writing nowhere; its drafts there are dropped.
                pos = p + min(j, max(n - 1, 0))
                positions.append(pos)
                slots.append(state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size
                             if j < n else -1)
                seq_lens.append(pos + 1)
        width = max(-(-(p + max(n, 1)) // self.block_size) for p, n in zip(first, steps))
        pin = self.device.type == "cuda"
        longs = torch.tensor([s.token_ids[-1] for s in states] + positions + slots, dtype=torch.int64,
                             pin_memory=pin).to(self.device, non_blocking=True)
        ints = torch.tensor(list(range(rows + 1)) + seq_lens, dtype=torch.int32,
                            pin_memory=pin).to(self.device, non_blocking=True)
        table = block_table.gather([s.block_table_row for s in states], width)
        table = (table.pin_memory() if pin else table).to(self.device, non_blocking=True)
        n = rows * self.k
        ids = longs[:rows]
        drafted = []
        carry = self._first_carry(states)
        for j in range(self.k):
            meta = AttentionMetadata(
                slot_mapping=longs[rows + n + j * rows: rows + n + (j + 1) * rows],
                query_start_loc=ints[: rows + 1], seq_lens=ints[rows + 1 + j * rows: rows + 1 + (j + 1) * rows],
                block_tables=table, max_query_len=1, max_seq_len=0)
            inputs = ModelInputs(ids, longs[rows + j * rows: rows + (j + 1) * rows], meta,
                                 torch.arange(rows, device=self.device), list(range(rows)))
            hidden, carry = self._step(inputs, carry)
            ids = self.target.compute_logits(hidden).argmax(dim=-1)
            drafted.append(ids)
        tokens = torch.stack(drafted, dim=1).tolist()
        return [row[:n] for row, n in zip(tokens, steps)]

    def _first_carry(self, states: list[CachedRequestState]) -> torch.Tensor | None:
        return None

    def _step(self, inputs: ModelInputs, carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft step of one token per row: its hidden states (for the target's LM head) and what the next
        step reads besides its token."""
        raise NotImplementedError

    def _longs(self, values: list[int]) -> torch.Tensor:
        """A small int64 index on the device; through pinned memory on CUDA, so the copy does not wait for the
        queued work (async scheduling launches the next step before this one finishes)."""
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=torch.int64, pin_memory=pin).to(self.device, non_blocking=True)

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

    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        spec = self.config.speculative
        # The catch-up steps have the target's shapes (decode, verify); the proposal steps are decodes.
        runner = GraphRunner(self.model, max_num_seqs, max_blocks_per_seq, self.device,
                             list(range(2, self.k + 2)), verify_batch_limit(max_num_seqs, spec.disable_by_batch_size))
        with torch.inference_mode():
            self.capture_seconds = runner.capture()
        self.graph_runner = runner

    def catch_up(self, inputs: ModelInputs, counts: list[int], states: list[CachedRequestState],
                 hidden: torch.Tensor) -> None:
        self._run(self.model, inputs, counts)

    def _step(self, inputs: ModelInputs, carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._run(self.model, inputs, [1] * inputs.input_ids.shape[0]), None


class EagleDrafter(Drafter):
    """An EAGLE-style head (method 'eagle') on the target's hidden states, sharing its embedding and LM head."""

    def __init__(self, config: EngineConfig, target: nn.Module, dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(config, target, dtype, kv_dtype, device)
        hidden = self.model.config.hidden_size
        # Per block-table row: the target's hidden state at the row's last kept position (its next feature).
        self.features = torch.zeros(config.scheduler.max_num_seqs, hidden, dtype=dtype, device=device)
        self.feature_buf = torch.zeros(max(config.scheduler.max_num_seqs, 1), hidden, dtype=dtype, device=device)
        self.embed = target.model.embed_tokens

    def _load(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
        load_format = "dummy" if config.model.load_format == "dummy" else "auto"
        return load_eagle_head(config.speculative.model, dtype, device, load_format, config.model.seed)

    def _head_from_buffer(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The head on the static feature buffer: what the proposal graphs capture."""
        return self.model(ids, self.feature_buf[: ids.shape[0]], positions, meta, self.embed)

    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        runner = GraphRunner(self._head_from_buffer, max_num_seqs, max_blocks_per_seq, self.device)
        with torch.inference_mode():
            self.capture_seconds = runner.capture()
        self.graph_runner = runner

    def reset_row(self, row: int) -> None:
        self.features[row].zero_()

    def catch_up(self, inputs: ModelInputs, counts: list[int], states: list[CachedRequestState],
                 hidden: torch.Tensor) -> None:
        # Token i of the step reads the target's hidden state at the position before it: hidden[i - 1] within its
        # row, the row's kept feature for its first token.
        rows = [s.block_table_row for s in states]
        starts = [0, *itertools.accumulate(counts)]
        features = torch.cat([hidden[:1], hidden[:-1]])
        first, row_index = self._longs(starts[:-1]), self._longs(rows)
        features.index_copy_(0, first, self.features.index_select(0, row_index))
        self.model(inputs.input_ids, features, inputs.positions, inputs.attn_metadata, self.embed)
        last = self._longs([end - 1 for end in starts[1:]])
        self.features.index_copy_(0, row_index, hidden.index_select(0, last).to(self.features.dtype))

    def settle(self, rows: list[int], hidden_index: list[int], hidden: torch.Tensor) -> None:
        if not rows:
            return
        index, row_index = self._longs(hidden_index), self._longs(rows)
        self.features.index_copy_(0, row_index, hidden.index_select(0, index).to(self.features.dtype))

    def _first_carry(self, states: list[CachedRequestState]) -> torch.Tensor | None:
        return self.features.index_select(0, self._longs([s.block_table_row for s in states]))

    def _step(self, inputs: ModelInputs, carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = inputs.input_ids.shape[0]
        self.feature_buf[:rows].copy_(carry)
        hidden = self._run(self._head_from_buffer, inputs, [1] * rows)
        return hidden, hidden  # the head's output feature drives its next step


def build_drafter(config: EngineConfig, target: nn.Module, dtype: torch.dtype, kv_dtype: torch.dtype,
                  device: torch.device) -> Drafter | None:
    spec = config.speculative
    if spec is None or not spec.uses_model:
        return None
    cls = EagleDrafter if spec.method == "eagle" else DraftModelDrafter
    return cls(config, target, dtype, kv_dtype, device)
