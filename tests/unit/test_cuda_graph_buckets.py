"""The device-independent half of the decode and verify CUDA graphs: buckets and the padding of static inputs."""

from __future__ import annotations

import pytest
import torch

from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.cuda_graph import (
    GraphBuffers,
    GraphRunner,
    bucket_for,
    capture_sizes,
    is_decode_only,
    padded_token_index,
    verify_batch_limit,
)
from kestrel.worker.input_batch import ModelInputs


def test_capture_sizes_follow_vllm_spacing() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 32]
    sizes = capture_sizes(300)
    assert sizes[-3:] == [272, 288, 304]
    assert 256 in sizes and 264 not in sizes
    assert sizes == sorted(set(sizes))


@pytest.mark.parametrize("max_num_seqs", [1, 3, 7, 8, 9, 128, 129, 256, 257, 1000])
def test_every_batch_has_a_bucket(max_num_seqs: int) -> None:
    sizes = capture_sizes(max_num_seqs)
    assert sizes[-1] >= max_num_seqs and (len(sizes) == 1 or sizes[-2] < max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        bucket = bucket_for(n, sizes)
        assert bucket is not None and bucket >= n
        assert all(s < n for s in sizes if s < bucket)
    assert bucket_for(sizes[-1] + 1, sizes) is None


def test_capture_sizes_rejects_zero() -> None:
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_is_decode_only() -> None:
    assert is_decode_only([1, 1, 1])
    assert not is_decode_only([1, 2])
    assert not is_decode_only([])


def _buffers(max_batch: int, max_blocks: int, query_lens: tuple[int, ...] = (1,), max_tokens: int | None = None):
    return GraphBuffers(max_tokens or max_batch * max(query_lens), max_batch, max_blocks, list(query_lens),
                        torch.device("cpu"))


def _decode_inputs(n: int, width: int, offset: int = 0) -> ModelInputs:
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64) + 100 + offset,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.arange(n, dtype=torch.int32) + 5 + offset,
        block_tables=torch.arange(n * width, dtype=torch.int32).reshape(n, width) + 1 + offset,
        max_query_len=1, max_seq_len=n + 4 + offset,
    )
    return ModelInputs(input_ids=torch.arange(n) + 7 + offset, positions=torch.arange(n) + 4 + offset,
                       attn_metadata=meta, logits_indices=torch.arange(n), sampled_rows=list(range(n)))


def test_load_copies_rows_and_pads_the_rest() -> None:
    buffers = _buffers(8, 4)
    with torch.inference_mode():
        buffers.load(_decode_inputs(8, 4, offset=50), 8)  # a larger earlier step leaves stale rows
        inputs = _decode_inputs(3, 2)
        buffers.load(inputs, 4)
    meta = buffers.metadata(4)
    assert meta.max_query_len == 1 and meta.num_seqs == 4
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert buffers.input_ids[:4].tolist() == inputs.input_ids.tolist() + [0]
    assert buffers.positions[:4].tolist() == inputs.positions.tolist() + [0]
    assert meta.slot_mapping.tolist() == inputs.attn_metadata.slot_mapping.tolist() + [-1]
    assert meta.seq_lens.tolist() == inputs.attn_metadata.seq_lens.tolist() + [1]
    assert torch.equal(meta.block_tables[:3, :2], inputs.attn_metadata.block_tables)
    assert meta.block_tables[3].tolist() == [0, 0, 0, 0]
    assert meta.block_tables.shape == (4, 4)


def test_padding_reads_nothing_harmful_through_attention() -> None:
    """Real rows of a padded decode batch attend exactly as the unpadded batch does."""
    from kestrel.kernels.attention import paged_attention_ref

    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, heads, head = 6, 16, 2, 4, 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head, generator=g)
    inputs = _decode_inputs(3, 2)
    meta = inputs.attn_metadata
    meta = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, torch.tensor([20, 3, 17], dtype=torch.int32),
                             torch.tensor([[1, 2], [3, 0], [4, 5]], dtype=torch.int32), 1, 20)
    inputs = ModelInputs(inputs.input_ids, inputs.positions, meta, inputs.logits_indices, inputs.sampled_rows)
    buffers = _buffers(8, 4)
    buffers.load(inputs, 8)
    q = torch.randn(8, heads, head, generator=g)
    padded_meta = buffers.metadata(8)
    padded = paged_attention_ref(q, k_cache, v_cache, padded_meta.query_start_loc, padded_meta.seq_lens,
                                 padded_meta.block_tables, 0.3)
    plain = paged_attention_ref(q[:3], k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3)
    assert torch.equal(padded[:3], plain)
    assert torch.isfinite(padded).all()


def test_load_rejects_oversized_batches() -> None:
    buffers = _buffers(4, 2)
    with pytest.raises(ValueError):
        buffers.load(_decode_inputs(5, 2), 4)
    with pytest.raises(ValueError):
        buffers.load(_decode_inputs(2, 3), 2)


class EagerReplayRunner(GraphRunner):
    """The graph runner with each replay done eagerly on the static buffers: runs on CPU and exercises the
    same padding, buffers and ModelRunner dispatch as the CUDA graphs (only capture/replay differ)."""

    replays: list[tuple[int, int]]
    verify_replays: list[tuple[int, int, int]]

    def begin_capture(self) -> None:
        super().begin_capture()
        self.replays, self.verify_replays, self.recorded = [], [], []

    def _record(self, fn):
        # The capture-time run as on a GPU (its inputs all padding), without a graph.
        self.recorded.append(len(self.recorded))
        return None, fn()

    def _replay(self, key: tuple[int, int]) -> None:
        q, bucket = key
        real = int((self.buffers.slot_mapping[:q * bucket] >= 0).sum())
        if q == 1:
            self.replays.append((bucket, real))
        else:
            self.verify_replays.append((q, bucket, real))
        self.outputs[key] = self.forward(*self._inputs(key))


def _engines_with_emulated_graphs(tmp_path, max_num_seqs: int):
    """A tiny checkpoint's eager engine and a second engine whose runner holds an `EagerReplayRunner` with nothing
    captured yet (the test captures or queues its graphs)."""
    from kestrel import LLM
    from kestrel.loader.model_init import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, arch="llama", seed=0)
    eager, graphed = (LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=max_num_seqs, device="cpu")
                      for _ in range(2))
    runner = graphed.runner
    runner.graph_runner = EagerReplayRunner(runner.model, max_num_seqs, 64 // runner.block_size, runner.device)
    return eager, graphed, runner.graph_runner


def test_padded_decode_through_the_model_matches_eager(tmp_path) -> None:
    """Greedy tokens of 3 requests (padded to bucket 4) and 1 request equal the eager engine's."""
    from kestrel import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    batches = [[{"prompt_token_ids": torch.randint(3, 200, (5 + 9 * i,), generator=g).tolist()} for i in range(n)]
               for n in (3, 1)]
    eager, padded, graph_runner = _engines_with_emulated_graphs(tmp_path, 6)
    graph_runner.capture()
    for batch in batches:
        expected = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in padded.generate(batch, params, use_tqdm=False)]
        assert got == expected
    assert graph_runner.sizes == [1, 2, 4, 8]
    assert (4, 3) in graph_runner.replays and (1, 1) in graph_runner.replays
    # 11 decode steps per batch (the first token comes from the prefill step, which runs eagerly).
    assert len(graph_runner.replays) == 2 * (params.max_tokens - 1)


def test_capture_stops_at_the_cap() -> None:
    from kestrel.worker.cuda_graph import MAX_CAPTURE_BATCH

    runner = GraphRunner(lambda *a: a[0], 4096, 4, torch.device("cpu"))
    assert runner.max_batch == MAX_CAPTURE_BATCH
    assert not runner.can_run([1] * (MAX_CAPTURE_BATCH + 1), 1)


def test_rows_padded_earlier_stay_padding() -> None:
    buffers = _buffers(8, 4)
    buffers.load(_decode_inputs(8, 4, offset=50), 8)
    buffers.load(_decode_inputs(2, 2), 8)
    buffers.load(_decode_inputs(5, 3, offset=9), 8)
    assert buffers.num_loaded == 5
    assert buffers.slot_mapping[5:].tolist() == [-1] * 3
    assert buffers.seq_lens[5:].tolist() == [1] * 3
    assert buffers.block_tables[5:].abs().sum() == 0 and buffers.input_ids[5:].abs().sum() == 0
    buffers.load(_decode_inputs(1, 1), 1)
    assert buffers.slot_mapping[1:].tolist() == [-1] * 7


# ----- verify graphs (speculative decoding: rows of up to k + 1 query tokens) ------------------------------------

def test_verify_batch_limit_and_graph_keys() -> None:
    assert verify_batch_limit(256, None) == 16
    assert verify_batch_limit(256, 4) == 4
    assert verify_batch_limit(6, None) == 6
    assert verify_batch_limit(1024, 1000) == 32
    runner = EagerReplayRunner(lambda *a: a[0], 64, 4, torch.device("cpu"), verify_query_lens=[2, 3, 4],
                               verify_batch=4)
    runner.capture()
    assert runner.verify_sizes == [1, 2, 4]
    assert runner.key_for([1, 1, 1], 4) == (1, 4)
    assert runner.key_for([3], 4) == (3, 1)
    assert runner.key_for([1, 4, 2], 4) == (4, 4)  # padded to the longest row
    assert runner.key_for([5], 4) is None  # longer than any captured query (a prefill chunk)
    assert runner.key_for([2] * 5, 4) is None  # more rows than the verify buckets hold
    assert runner.key_for([2], 5) is None  # wider block table than the buffers
    assert runner.buffers.max_tokens == max(64, 4 * 4)


def test_padded_token_index_puts_each_row_last_in_its_slot() -> None:
    assert padded_token_index([3, 3], 3) is None
    assert padded_token_index([1, 3, 2], 3) == [2, 3, 4, 5, 7, 8]
    assert padded_token_index([2], 4) == [2, 3]


def _verify_inputs(counts: list[int], seq_lens: list[int], width: int) -> ModelInputs:
    n = sum(counts)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    positions = [p for c, s in zip(counts, seq_lens) for p in range(s - c, s)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(positions, dtype=torch.int64) + 1000,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(len(counts) * width, dtype=torch.int32).reshape(len(counts), width) % 6,
        max_query_len=max(counts), max_seq_len=max(seq_lens),
    )
    return ModelInputs(input_ids=torch.arange(n) + 7, positions=torch.tensor(positions), attn_metadata=meta,
                       logits_indices=torch.tensor([s - 1 for s in starts[1:]]), sampled_rows=list(range(len(counts))))


def test_verify_load_pads_rows_at_their_front() -> None:
    buffers = _buffers(4, 3, query_lens=(1, 3), max_tokens=12)
    buffers.load(_decode_inputs(4, 3, offset=50), 4)  # stale decode data in the first tokens
    inputs = _verify_inputs([1, 3, 2], [9, 20, 33], 3)
    index = buffers.load(inputs, 4, 3, [1, 3, 2])
    assert index.tolist() == [2, 3, 4, 5, 7, 8]
    meta = buffers.metadata(4, 3)
    assert meta.max_query_len == 3 and meta.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert meta.slot_mapping.tolist() == [-1, -1, 1008, 1017, 1018, 1019, -1, 1031, 1032, -1, -1, -1]
    assert buffers.input_ids[:12].tolist() == [0, 0, 7, 8, 9, 10, 0, 11, 12, 0, 0, 0]
    assert buffers.positions[:12].tolist() == [0, 0, 8, 17, 18, 19, 0, 31, 32, 0, 0, 0]
    assert meta.seq_lens.tolist() == [9, 20, 33, 1]  # real rows keep their seq_len; the padded row has 1
    # A later uniform decode step leaves every token past its own as padding again.
    buffers.load(_decode_inputs(2, 3), 2)
    assert buffers.slot_mapping[2:].tolist() == [-1] * 10 and buffers.seq_lens[2:].tolist() == [1, 1]
    with pytest.raises(ValueError):
        buffers.load(_verify_inputs([4], [9], 3), 1, 3, [4])  # a row longer than the graph's q


def test_front_padded_verify_attention_equals_the_unpadded_batch() -> None:
    """Real query tokens of a padded verify layout attend exactly as in the unpadded step (the pad tokens before
    them read only keys their row owns, or none; a row shorter than q included)."""
    from kestrel.kernels.attention import paged_attention_ref

    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, heads, head = 8, 16, 2, 4, 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head, generator=g)
    counts, seq_lens = [1, 5, 3, 2], [20, 33, 3, 17]  # row 2: shorter (3 keys) than q = 5
    inputs = _verify_inputs(counts, seq_lens, 3)
    meta = inputs.attn_metadata
    meta = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                             torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0], [7, 1, 0]], dtype=torch.int32),
                             5, 33)
    inputs = ModelInputs(inputs.input_ids, inputs.positions, meta, inputs.logits_indices, inputs.sampled_rows)
    buffers = _buffers(4, 3, query_lens=(1, 5), max_tokens=20)
    index = buffers.load(inputs, 4, 5, counts)
    q = torch.randn(sum(counts), heads, head, generator=g)
    padded_q = torch.zeros(20, heads, head).index_copy_(0, index, q)
    pm = buffers.metadata(4, 5)
    padded = paged_attention_ref(padded_q, k_cache, v_cache, pm.query_start_loc, pm.seq_lens, pm.block_tables, 0.3)
    plain = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3)
    torch.testing.assert_close(padded.index_select(0, index), plain, rtol=1e-5, atol=1e-6)  # einsum shapes differ


@pytest.mark.parametrize("capture", ["startup", "serving"])
def test_verify_steps_through_the_graph_path_match_eager(capture: str) -> None:
    """n-gram speculation on kestrel-tiny with verify steps replayed through the graph runner's padded buffers
    (eagerly, on CPU): the greedy tokens equal the plain engine's, and verify replays happened, padded ones
    (a row with fewer drafts than the longest) included; with the graphs captured before the steps, or one before
    each step as the default `graph_capture="serving"` does (steps whose graph is missing run eagerly)."""
    from kestrel import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = ["x = [1, 2, 3, 1, 2, 3, 1, 2", "import os\nimport sys\nimport os\nimport sys\n",
               "def f(a):\n    return a\n\n\ndef g(b):\n"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eager = LLM(dtype="float32", max_model_len=128, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(dtype="float32", max_model_len=128, max_num_seqs=4, speculative_config=spec)
    runner = llm.runner
    graph_runner = EagerReplayRunner(runner.model, 4, 128 // runner.block_size, runner.device,
                                     verify_query_lens=[2, 3, 4], verify_batch=4)
    if capture == "startup":
        graph_runner.capture()
    else:
        graph_runner.begin_capture()
    runner.graph_runner = graph_runner
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert llm.stats.num_spec_accepted_tokens > 0
    if capture == "serving":
        assert graph_runner.recorded  # captured before the steps, one each, and (below) replayed after
    assert graph_runner.verify_replays
    assert any(real < q * bucket for q, bucket, real in graph_runner.verify_replays)


# ----- graphs captured while the engine serves (graph_capture="serving") ----------------------------------------

def test_a_step_pads_to_the_smallest_bucket_captured_so_far() -> None:
    runner = EagerReplayRunner(lambda *a: a[0], 16, 4, torch.device("cpu"))
    runner.begin_capture()
    assert runner.pending and runner.key_for([1] * 3, 4) is None  # nothing captured: the step runs eagerly
    runner.capture_next()  # the largest first
    assert runner.captured_sizes == {1: [16]} and runner.key_for([1] * 3, 4) == (1, 16)
    runner.capture_next()
    assert runner.key_for([1] * 3, 4) == (1, 8) and runner.key_for([1] * 9, 4) == (1, 16)
    while runner.pending:
        runner.capture_next()
    assert runner.captured_sizes == {1: runner.sizes} and runner.key_for([1] * 3, 4) == (1, 4)
    assert len(runner.recorded) == len(runner.keys)


def test_a_capture_between_steps_resets_what_a_step_loaded() -> None:
    """The capture-time run reads padding only, whatever the step before it loaded: its K/V go nowhere."""
    seen: list[list[int]] = []

    def forward(ids, positions, meta):
        seen.append(meta.slot_mapping.tolist())
        return ids

    runner = EagerReplayRunner(forward, 8, 4, torch.device("cpu"))
    runner.begin_capture()
    runner.capture_next()  # bucket 8
    runner.run(_decode_inputs(5, 3, offset=9), [1] * 5)
    assert seen[-1][:5] != [-1] * 5  # the step's own slots
    runner.capture_next()
    assert seen[-1] == [-1] * len(seen[-1])
    assert runner.run(_decode_inputs(2, 2), [1] * 2).shape[0] == 2


def test_graphs_captured_while_serving_give_the_eager_tokens(tmp_path) -> None:
    """graph_capture="serving" as the runner does it: one capture before each step; steps without their graph run
    eagerly, later ones replay; greedy tokens equal the eager engine's, and the engine's idle work captures the
    rest."""
    from kestrel import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    batch = [{"prompt_token_ids": torch.randint(3, 200, (4 + 5 * i,), generator=g).tolist()} for i in range(3)]
    eager, serving, graph_runner = _engines_with_emulated_graphs(tmp_path, 16)
    runner = serving.runner
    graph_runner.begin_capture()
    assert runner.graphs_pending and serving.engine.has_idle_work
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in serving.generate(batch, params, use_tqdm=False)] == expected
    # 3 steps (a prefill, two decodes of 3 rows), one capture before each: buckets 16, 8, 4; the decodes padded to
    # the smallest captured then (8, and 4 after its capture).
    assert graph_runner.captured_sizes == {1: [4, 8, 16]}
    assert graph_runner.replays == [(8, 3), (4, 3)]
    serving.engine.do_idle_work()
    assert graph_runner.captured_sizes == {1: [2, 4, 8, 16]}
    serving.engine.finish_idle_work()
    assert not runner.graphs_pending and not serving.engine.has_idle_work
    assert graph_runner.captured_sizes == {1: [1, 2, 4, 8, 16]}
    assert [o.outputs[0].token_ids for o in serving.generate(batch, params, use_tqdm=False)] == expected
    assert graph_runner.replays[-2:] == [(4, 3), (4, 3)]


def test_an_idle_async_engine_captures_its_pending_graphs(tmp_path) -> None:
    """The server's engine thread with nothing to run captures the pending graphs one by one, then waits; a request
    afterwards replays them and gets the eager engine's tokens."""
    import asyncio
    import time

    from kestrel import SamplingParams
    from kestrel.entrypoints.async_engine import AsyncEngine

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [5, 9, 13, 21, 34]
    eager, llm, graph_runner = _engines_with_emulated_graphs(tmp_path, 8)
    expected = eager.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    graph_runner.begin_capture()
    engine = AsyncEngine(llm.engine, llm.tokenizer).start()
    try:
        deadline = time.monotonic() + 60
        while llm.runner.graphs_pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.runner.graphs_pending and graph_runner.captured_sizes == {1: [1, 2, 4, 8]}

        async def one() -> list[int]:
            last = None
            async for out in engine.generate("r", prompt, params):
                last = out
            return last.outputs[0].token_ids

        assert asyncio.run(one()) == expected
        assert graph_runner.replays == [(1, 1)] * (params.max_tokens - 1)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kwargs,refusal", [
    ({"graph_capture": "later"}, r"graph_capture='later': expected one of \['serving', 'startup'\]"),
    ({"graph_capture": "serving", "enforce_eager": True}, "enforce_eager=True turns every CUDA graph off"),
    ({"graph_capture": "startup", "device": "cpu"}, "a CPU engine captures no CUDA graphs"),
    ({"graph_capture": "serving", "distributed_executor_backend": "mp"}, "captures its graphs at start-up"),
    ({"graph_capture": "serving", "prompt_compressor": "kestrel-tiny"}, "prompt compression runs its model"),
])
def test_graph_capture_is_refused_where_it_cannot_hold(kwargs, refusal) -> None:
    from kestrel.config import ConfigError, EngineConfig
    from kestrel.tiny import default_model_path

    with pytest.raises(ConfigError, match=refusal):
        EngineConfig.from_kwargs(str(default_model_path()), **kwargs)


def test_an_explicit_graph_capture_on_a_runner_without_graphs_is_refused() -> None:
    """device="auto" resolves to the CPU here: the runner refuses what the config could not tell."""
    from kestrel import LLM
    from kestrel.config import ConfigError

    with pytest.raises(ConfigError, match="graph_capture='serving': this engine captures no CUDA graphs"):
        LLM(dtype="float32", max_model_len=64, graph_capture="serving")


def test_graphs_ready_at_marks_the_last_capture() -> None:
    runner = EagerReplayRunner(lambda *a: a[0], 4, 4, torch.device("cpu"))
    runner.begin_capture()
    runner.capture_next()
    assert runner.finished_at is None
    while runner.pending:
        runner.capture_next()
    assert runner.finished_at is not None


@pytest.mark.parametrize("setting,engine_args,resolved", [
    (None, {}, "serving"),  # the default where the runner captures graphs
    (None, {"distributed_executor_backend": "mp"}, "startup"),  # the executor's ranks have no idle turn to capture in
    (None, {"prompt_compressor": "kestrel-tiny"}, "startup"),  # its forwards run on another thread
    ("startup", {}, "startup"),
    ("serving", {}, "serving"),
])
def test_graph_capture_resolves_to_serving_unless_the_config_needs_startup(setting, engine_args, resolved) -> None:
    """The runner's rule for graph_capture (RunnerSetup._resolve_graph_capture) on a runner that captures graphs,
    which takes a CUDA device: the config is the engine's own, the runner's side stands in."""
    from types import SimpleNamespace

    from kestrel.config import ConfigError, EngineConfig
    from kestrel.tiny import default_model_path
    from kestrel.worker.runner_setup import RunnerSetup

    config = EngineConfig.from_kwargs(str(default_model_path()), graph_capture=setting, **engine_args)
    runner = SimpleNamespace(config=config, _captures_graphs=lambda: True)
    assert RunnerSetup._resolve_graph_capture(runner) == resolved
    runner._captures_graphs = lambda: False  # a runner without graphs resolves to none, and an explicit one is refused
    if setting is None:
        assert RunnerSetup._resolve_graph_capture(runner) is None
    else:
        with pytest.raises(ConfigError, match="this engine captures no CUDA graphs"):
            RunnerSetup._resolve_graph_capture(runner)
