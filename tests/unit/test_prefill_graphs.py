"""The device-independent half of the prefill / mixed-step CUDA graphs: buckets, the padded static inputs, padding
that is harmless through attention and the whole model (eager replays on CPU, where graphs are eager code), and the
max_prefill_graph_tokens setting."""

from __future__ import annotations

import pytest
import torch

from kestrel.config import ConfigError, EngineConfig
from kestrel.kernels.attention import paged_attention_ref
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.cuda_graph import GraphRunner
from kestrel.worker.input_batch import ModelInputs
from kestrel.worker.prefill_graph import PrefillBuckets, PrefillBuffers, is_valid_prefill_limit

CPU = torch.device("cpu")


def test_buckets_double_up_to_the_limit_and_the_step_budget() -> None:
    buckets = PrefillBuckets.for_engine(512, 8192, 256)
    assert buckets.tokens == (16, 32, 64, 128, 256, 512) and buckets.rows == (2, 8, 32)
    small = PrefillBuckets.for_engine(512, 100, 4)  # no bucket past the first holding a whole 100-token step
    assert small.tokens == (16, 32, 64, 128) and small.rows == (2, 8)
    assert PrefillBuckets.for_engine(16, 8192, 1) == PrefillBuckets((16,), (2,))
    assert PrefillBuckets.for_engine(0, 8192, 8) is None
    shapes = buckets.graph_shapes()
    assert (16, 8) in shapes and (16, 32) not in shapes and len(shapes) == 17
    for bad in (-16, 8, 100, 16384):
        assert not is_valid_prefill_limit(bad)
        with pytest.raises(ValueError):
            PrefillBuckets.for_engine(bad, 8192, 8)


def test_a_step_takes_the_smallest_buckets_holding_it_and_its_pad_row() -> None:
    buckets = PrefillBuckets.for_engine(512, 8192, 256)
    assert buckets.key_for([128]) == (128, 2)  # the 128-token prompt: one row, no pad row
    assert buckets.key_for([100]) == (128, 2)  # one row and the pad row
    assert buckets.key_for([5, 1, 1]) == (16, 8)
    assert buckets.key_for([1, 7, 1, 1, 1, 1, 1, 3]) == (16, 8)  # 16 tokens in 8 rows: no pad row needed
    assert buckets.key_for([2] * 7 + [2]) == (16, 8)  # 16 tokens exactly: no pad row needed
    assert buckets.key_for([2] * 6 + [3]) == (16, 8)  # 15 tokens: 7 rows and the pad row
    assert buckets.key_for([2] * 31) == (64, 32) and buckets.key_for([2] * 32) == (64, 32)
    assert buckets.key_for([2] * 33) is None  # 34 rows with the pad row: more than any row bucket
    assert buckets.key_for([513]) is None  # longer than the largest token bucket: eager
    assert buckets.key_for([1, 1, 1]) is None  # decode-only: the decode graphs' (or eager)
    assert buckets.key_for([]) is None


def _step(counts: list[int], seq_lens: list[int], width: int, offset: int = 0) -> ModelInputs:
    """A flat step: row r has counts[r] query tokens, the last of its seq_lens[r]."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    positions = [p for c, s in zip(counts, seq_lens) for p in range(s - c, s)]
    n = sum(counts)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(positions, dtype=torch.int64) + 1000 + offset,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=(torch.arange(len(counts) * width, dtype=torch.int32).reshape(len(counts), width) + offset) % 7,
        max_query_len=max(counts), max_seq_len=max(seq_lens),
    )
    return ModelInputs(input_ids=torch.arange(n) + 7 + offset, positions=torch.tensor(positions), attn_metadata=meta,
                       logits_indices=torch.tensor([s - 1 for s in starts[1:]]), sampled_rows=list(range(len(counts))))


def test_load_keeps_the_step_order_and_adds_the_pad_row() -> None:
    buckets = PrefillBuckets((16, 32), (2, 8))
    buffers = PrefillBuffers(buckets, 4, CPU)
    buffers.load(_step([20, 1, 5, 2], [20, 9, 40, 3], 4, offset=50), 32, 8)  # a larger step leaves stale data
    step = _step([3, 1, 6], [3, 17, 30], 2)
    buffers.load(step, 16, 8)
    meta = buffers.metadata(16, 8)
    assert meta.max_query_len == 16 and meta.max_seq_len == 0 and meta.num_seqs == 8
    assert meta.query_start_loc.tolist() == [0, 3, 4, 10, 16, 16, 16, 16, 16]  # pad row 3 owns tokens 10..15
    assert meta.seq_lens.tolist() == [3, 17, 30, 6, 1, 1, 1, 1]  # the pad row's causal layout: 6 keys
    assert buffers.input_ids[:16].tolist() == step.input_ids.tolist() + [0] * 6
    assert buffers.positions[:16].tolist() == step.positions.tolist() + [0] * 6
    assert meta.slot_mapping.tolist() == step.attn_metadata.slot_mapping.tolist() + [-1] * 6
    assert torch.equal(meta.block_tables[:3, :2], step.attn_metadata.block_tables)
    assert meta.block_tables[3:].abs().sum() == 0  # the pad row and the empty rows read block 0 at most
    assert buffers.slot_mapping[10:].tolist() == [-1] * 22 and buffers.input_ids[10:].abs().sum() == 0
    # A step filling its bucket exactly has no pad row: every row after its own is empty.
    full = _step([8, 8], [8, 20], 2)
    buffers.load(full, 16, 2)
    assert buffers.metadata(16, 2).query_start_loc.tolist() == [0, 8, 16]
    assert buffers.seq_lens.tolist() == [8, 20, 1, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError):
        buffers.load(_step([8, 8], [8, 20], 2), 16, 1)  # fewer rows than the step has
    with pytest.raises(ValueError):
        buffers.load(_step([9, 8], [9, 20], 2), 16, 8)  # more tokens than the bucket
    with pytest.raises(ValueError):
        buffers.load(_step([3], [3], 5), 16, 2)  # a block table wider than the buffers


def test_a_graph_is_captured_over_one_pad_row_holding_every_token_and_real_steps_load_after_it() -> None:
    """Capture-time runs see a step of padding alone: attention writes every token (an MoE router then routes real
    values, not stale memory), and the next real step loads as after a reset."""
    buckets = PrefillBuckets((16, 32), (2, 8))
    buffers = PrefillBuffers(buckets, 4, CPU)
    buffers.reset_padding()
    for tokens, rows in ((32, 8), (16, 2)):
        buffers.load_padding(tokens, rows)
        meta = buffers.metadata(tokens, rows)
        assert meta.query_start_loc.tolist() == [0] + [tokens] * rows
        assert meta.seq_lens.tolist() == [tokens] + [1] * (rows - 1)
        assert meta.slot_mapping.tolist() == [-1] * tokens and buffers.input_ids[:tokens].abs().sum() == 0
        q = torch.randn(tokens, 2, 8)
        cache = torch.randn(4, 16, 1, 8)
        out = paged_attention_ref(q, cache, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.5)
        assert torch.isfinite(out).all()
    step = _step([3, 1, 6], [3, 17, 30], 2)
    buffers.load(step, 16, 8)
    assert buffers.metadata(16, 8).query_start_loc.tolist() == [0, 3, 4, 10, 16, 16, 16, 16, 16]
    assert buffers.seq_lens.tolist() == [3, 17, 30, 6, 1, 1, 1, 1]


@pytest.mark.parametrize("counts,seq_lens", [([3, 1, 6, 1, 2], [3, 17, 30, 40, 2]), ([16], [16]), ([9], [31])])
def test_padded_attention_equals_the_unpadded_step(counts: list[int], seq_lens: list[int]) -> None:
    """Real query tokens attend exactly as in the unpadded step; the pad row's outputs are finite (they read
    block 0) and every token has an output."""
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, heads, head = 8, 16, 2, 4, 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head, generator=g)
    step = _step(counts, seq_lens, 3)
    buckets = PrefillBuckets((16, 32), (2, 8))
    tokens, rows = buckets.key_for(counts)
    buffers = PrefillBuffers(buckets, 3, CPU)
    buffers.load(step, tokens, rows)
    n = sum(counts)
    q = torch.randn(n, heads, head, generator=g)
    padded_q = torch.cat([q, torch.randn(tokens - n, heads, head, generator=g)])
    pm = buffers.metadata(tokens, rows)
    padded = paged_attention_ref(padded_q, k_cache, v_cache, pm.query_start_loc, pm.seq_lens, pm.block_tables, 0.3)
    meta = step.attn_metadata
    plain = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3)
    torch.testing.assert_close(padded[:n], plain, rtol=1e-6, atol=1e-6)  # einsum shapes may differ
    assert torch.isfinite(padded).all()


class EagerPrefillRunner(GraphRunner):
    """The graph runner with prefill graphs only, each replay done eagerly on the static buffers (CPU), and beside
    each replay the unpadded eager forward of the same step, kept to compare."""

    prefill_replays: list[tuple[int, int, list[int]]]
    compared: list[tuple[torch.Tensor, torch.Tensor]]

    def capture(self) -> float:
        self.prefill_replays, self.compared = [], []
        self.prefill_graphs = dict.fromkeys(self.prefill_keys)  # type: ignore[misc]
        return 0.0

    def run(self, inputs: ModelInputs, num_scheduled: list[int] | None = None, load_more=None) -> torch.Tensor:
        padded = super().run(inputs, num_scheduled, load_more)
        # The same K/V again into the same slots: the step's own inputs, so the cache ends up identical.
        eager = self.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        self.compared.append((padded.clone(), eager))
        self.prefill_replays.append((*self._last_key, list(num_scheduled or [])))
        return padded

    def _replay_prefill(self, key: tuple[int, int]) -> None:
        self._last_key = key
        self.prefill_outputs[key] = self.forward(*self._prefill_inputs(key))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from kestrel.loader.model_init import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("prefill-graphs")
    write_tiny_checkpoint(path, arch="llama", seed=0)
    return str(path)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_prefill_and_mixed_steps_through_padded_buffers_match_eager(checkpoint: str, quantization: str | None) -> None:
    """Three prompts, chunked by a 48-token step budget so prefill chunks share steps with decodes: every prefill
    and mixed step replays through the padded buffers (pad tokens, the pad row, empty rows), its real tokens' logits
    equal the unpadded forward's within float32 tolerance, and the greedy tokens equal the plain engine's."""
    from kestrel import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    batch = [{"prompt_token_ids": torch.randint(3, 200, (n,), generator=g).tolist()} for n in (5, 40, 70)]
    kwargs = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=48, device="cpu",
                  quantization=quantization)
    eager = LLM(checkpoint, **kwargs)
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    padded = LLM(checkpoint, **kwargs)
    runner = padded.runner
    buckets = PrefillBuckets.for_engine(64, 48, 4)
    graph_runner = EagerPrefillRunner(runner._run_model, 4, runner.max_blocks_per_seq, runner.device,
                                      prefill=buckets, block_size=runner.block_size)
    graph_runner.capture()
    runner.graph_runner = graph_runner
    got = [o.outputs[0].token_ids for o in padded.generate(batch, params, use_tqdm=False)]
    assert got == expected
    replays = graph_runner.prefill_replays
    assert any(sum(counts) < tokens for tokens, _, counts in replays)  # pad tokens and a pad row
    assert any(1 in counts and max(counts) > 1 for _, _, counts in replays)  # a mixed step: decodes + a chunk
    assert any(rows > len(counts) + 1 for _, rows, counts in replays)  # empty rows past the pad row
    model = runner.model
    for graph_hidden, eager_hidden in graph_runner.compared:
        torch.testing.assert_close(model.compute_logits(graph_hidden), model.compute_logits(eager_hidden),
                                   rtol=1e-4, atol=1e-4)


def test_max_prefill_graph_tokens_is_validated(checkpoint: str) -> None:
    for bad in (100, 8, 16384, -1, True):
        with pytest.raises(ConfigError, match="max_prefill_graph_tokens"):
            EngineConfig.from_kwargs(checkpoint, max_prefill_graph_tokens=bad)
    with pytest.raises(ConfigError, match="max_prefill_graph_tokens=512: enforce_eager"):
        EngineConfig.from_kwargs(checkpoint, max_prefill_graph_tokens=512, enforce_eager=True)
    with pytest.raises(ConfigError, match="max_prefill_graph_tokens=512: CUDA graphs are captured on one device"):
        EngineConfig.from_kwargs(checkpoint, max_prefill_graph_tokens=512, tensor_parallel_size=2)
    assert EngineConfig.from_kwargs(checkpoint, max_prefill_graph_tokens=512).max_prefill_graph_tokens == 512
    assert EngineConfig.from_kwargs(checkpoint).max_prefill_graph_tokens is None  # the runner decides
    assert EngineConfig.from_kwargs(checkpoint, max_prefill_graph_tokens=0).max_prefill_graph_tokens == 0


def test_max_prefill_graph_tokens_needs_a_cuda_device(checkpoint: str) -> None:
    from kestrel import LLM

    with pytest.raises(ConfigError, match="max_prefill_graph_tokens=256: CUDA graphs need a CUDA device"):
        LLM(checkpoint, dtype="float32", max_model_len=64, device="cpu", max_prefill_graph_tokens=256)
    # Unset, the limit follows the runner: a CPU engine captures no graphs, so it has none (and no error).
    assert LLM(checkpoint, dtype="float32", max_model_len=64, device="cpu").runner.prefill_graph_tokens == 0


def test_cli_flag_comes_from_the_config_field() -> None:
    from kestrel.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-prefill-graph-tokens", "256"])
    assert args.max_prefill_graph_tokens == 256


class ReplayedForward:
    """A stand-in for a captured CUDA graph on CPU: its output is one static tensor, and each replay runs the
    captured function again on the static inputs' current contents and writes into that tensor, as a replay does."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.output = fn()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.output.copy_(self.fn())


def test_capture_and_replay_paths_with_decode_and_prefill_graphs(checkpoint: str, monkeypatch, caplog) -> None:
    """GraphRunner.capture and run as on a GPU (graph capture swapped for `ReplayedForward`): decode steps replay
    decode graphs, prefill and mixed steps prefill graphs, capture time is logged, and greedy tokens equal the
    plain engine's."""
    import logging

    from kestrel import LLM, SamplingParams
    from kestrel.worker import cuda_graph

    def capture(fn, pool):
        graph = ReplayedForward(fn)
        return graph, graph.output

    monkeypatch.setattr(cuda_graph, "graph_pool", lambda device: None)
    monkeypatch.setattr(cuda_graph, "capture_graph", capture)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    batch = [{"prompt_token_ids": torch.randint(3, 200, (n,), generator=g).tolist()} for n in (3, 30, 50, 12)]
    kwargs = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=40, device="cpu")
    expected = [o.outputs[0].token_ids for o in LLM(checkpoint, **kwargs).generate(batch, params, use_tqdm=False)]
    llm = LLM(checkpoint, **kwargs)
    runner = llm.runner
    graphs = GraphRunner(runner._run_model, 4, runner.max_blocks_per_seq, runner.device,
                         prefill=PrefillBuckets.for_engine(512, 40, 4), block_size=runner.block_size)
    with caplog.at_level(logging.INFO, logger="kestrel.worker.cuda_graph"):
        graphs.capture()
    assert "captured 6 prefill CUDA graphs (token buckets [16, 32, 64] x row buckets [2, 8])" in caplog.text
    assert graphs.prefill_capture_seconds > 0 and graphs.capture_seconds >= graphs.prefill_capture_seconds
    runner.graph_runner = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert got == expected
    assert sum(g.replays for g in graphs.graphs.values()) >= params.max_tokens - 2  # decode steps
    assert sum(g.replays for g in graphs.prefill_graphs.values()) >= 3  # prompts and mixed steps
