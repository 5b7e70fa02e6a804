"""The device-independent half of the decode CUDA graphs: buckets and the padding of static inputs."""

from __future__ import annotations

import pytest
import torch

from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.cuda_graph import DecodeBuffers, DecodeGraphRunner, bucket_for, capture_sizes, is_decode_only
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
    buffers = DecodeBuffers(max_batch=8, max_blocks_per_seq=4, device=torch.device("cpu"))
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
    buffers = DecodeBuffers(max_batch=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    buffers.load(inputs, 8)
    q = torch.randn(8, heads, head, generator=g)
    padded_meta = buffers.metadata(8)
    padded = paged_attention_ref(q, k_cache, v_cache, padded_meta.query_start_loc, padded_meta.seq_lens,
                                 padded_meta.block_tables, 0.3)
    plain = paged_attention_ref(q[:3], k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3)
    assert torch.equal(padded[:3], plain)
    assert torch.isfinite(padded).all()


def test_load_rejects_oversized_batches() -> None:
    buffers = DecodeBuffers(max_batch=4, max_blocks_per_seq=2, device=torch.device("cpu"))
    with pytest.raises(ValueError):
        buffers.load(_decode_inputs(5, 2), 4)
    with pytest.raises(ValueError):
        buffers.load(_decode_inputs(2, 3), 2)


class EagerReplayRunner(DecodeGraphRunner):
    """The graph runner with each replay done eagerly on the static buffers: runs on CPU and exercises the
    same padding, buffers and ModelRunner dispatch as the CUDA graphs (only capture/replay differ)."""

    replays: list[tuple[int, int]]

    def capture(self) -> float:
        self.replays = []
        self.graphs = {bucket: None for bucket in self.sizes}  # type: ignore[misc]
        return 0.0

    def _replay(self, bucket: int) -> None:
        self.replays.append((bucket, int((self.buffers.slot_mapping[:bucket] >= 0).sum())))
        self.outputs[bucket] = self.forward(self.buffers.input_ids[:bucket], self.buffers.positions[:bucket],
                                            self.buffers.metadata(bucket))


def test_padded_decode_through_the_model_matches_eager(tmp_path) -> None:
    """Greedy tokens of 3 requests (padded to bucket 4) and 1 request equal the eager engine's."""
    from kestrel import LLM, SamplingParams
    from kestrel.loader.model_init import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, arch="llama", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    batches = [[{"prompt_token_ids": torch.randint(3, 200, (5 + 9 * i,), generator=g).tolist()} for i in range(n)]
               for n in (3, 1)]
    eager = LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=6, device="cpu")
    padded = LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=6, device="cpu")
    runner = padded.runner
    graph_runner = EagerReplayRunner(runner.model, 6, 64 // runner.block_size, runner.device)
    graph_runner.capture()
    runner.graph_runner = graph_runner
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

    runner = DecodeGraphRunner(lambda *a: a[0], 4096, 4, torch.device("cpu"))
    assert runner.max_batch == MAX_CAPTURE_BATCH
    assert not runner.can_run([1] * (MAX_CAPTURE_BATCH + 1), 1)


def test_rows_padded_earlier_stay_padding() -> None:
    buffers = DecodeBuffers(max_batch=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    buffers.load(_decode_inputs(8, 4, offset=50), 8)
    buffers.load(_decode_inputs(2, 2), 8)
    buffers.load(_decode_inputs(5, 3, offset=9), 8)
    assert buffers.num_loaded == 5
    assert buffers.slot_mapping[5:].tolist() == [-1] * 3
    assert buffers.seq_lens[5:].tolist() == [1] * 3
    assert buffers.block_tables[5:].abs().sum() == 0 and buffers.input_ids[5:].abs().sum() == 0
    buffers.load(_decode_inputs(1, 1), 1)
    assert buffers.slot_mapping[1:].tolist() == [-1] * 7
