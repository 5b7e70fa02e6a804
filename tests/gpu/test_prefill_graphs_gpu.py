"""GPU-only: prefill and mixed (prefill + decode) steps replayed in the prefill CUDA graphs
(`max_prefill_graph_tokens`, kestrel.worker.prefill_graph) give the eager forward's logits, pad tokens, the pad row
and empty rows included, and greedy generation with them equals enforce_eager (skipped on CPU).
Run on the H200: `.venv/bin/python -m pytest -q tests/gpu/test_prefill_graphs_gpu.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from replay_log import record_replays

from kestrel import LLM, SamplingParams
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.input_batch import ModelInputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prefill-graphs")
    write_tiny_checkpoint(path, arch="llama", seed=4)
    return path


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prefill-graphs-moe")
    write_tiny_checkpoint(path, arch="qwen3_moe", seed=4)
    return path


def _step(counts: list[int], seq_lens: list[int], block_size: int) -> ModelInputs:
    """Rows r own blocks 8r .. 8r + 7; each computes its last counts[r] positions."""
    g = torch.Generator().manual_seed(sum(seq_lens) + len(counts))
    ids, positions, slots, starts = [], [], [], [0]
    for row, (count, seq_len) in enumerate(zip(counts, seq_lens)):
        for p in range(seq_len - count, seq_len):
            positions.append(p)
            slots.append((8 * row + p // block_size) * block_size + p % block_size)
        ids += torch.randint(3, 200, (count,), generator=g).tolist()
        starts.append(starts[-1] + count)
    table = torch.tensor([[8 * r + b for b in range(8)] for r in range(len(counts))], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots, device="cuda"), torch.tensor(starts, dtype=torch.int32, device="cuda"),
                             torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), table.cuda(), max(counts),
                             max(seq_lens))
    return ModelInputs(torch.tensor(ids, device="cuda"), torch.tensor(positions, device="cuda"), meta,
                       torch.tensor([s - 1 for s in starts[1:]], device="cuda"), list(range(len(counts))))


def test_prefill_graphs_are_on_by_default_where_graphs_are_captured(checkpoint: Path) -> None:
    from kestrel.config import DEFAULT_PREFILL_GRAPH_TOKENS

    llm = LLM(str(checkpoint), dtype="bfloat16", max_model_len=128, max_num_seqs=8, device="cuda", kv_cache_blocks=64)
    graphs = llm.runner.graph_runner
    assert llm.runner.prefill_graph_tokens == DEFAULT_PREFILL_GRAPH_TOKENS
    assert graphs is not None and graphs.prefill is not None
    assert graphs.prefill.max_tokens <= DEFAULT_PREFILL_GRAPH_TOKENS
    eager = LLM(str(checkpoint), dtype="bfloat16", max_model_len=128, max_num_seqs=8, device="cuda",
                kv_cache_blocks=64, enforce_eager=True)
    assert eager.runner.prefill_graph_tokens == 0 and eager.runner.graph_runner is None


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "fp8")])
def test_prefill_graph_logits_match_eager(checkpoint: Path, dtype: str, quantization: str | None) -> None:
    llm = LLM(str(checkpoint), dtype=dtype, quantization=quantization, max_model_len=128, max_num_seqs=8,
              device="cuda", kv_cache_blocks=64, max_prefill_graph_tokens=128, graph_capture="startup")
    runner = llm.runner
    graphs = runner.graph_runner
    assert graphs is not None and graphs.prefill is not None
    assert graphs.prefill.tokens == (16, 32, 64, 128) and graphs.prefill.rows == (2, 8, 32)
    assert set(graphs.prefill_graphs) == set(graphs.prefill.graph_shapes()) and graphs.prefill_capture_seconds > 0
    model, bs = runner.model, runner.block_size
    seq_lens = [100, 70, 5, 120, 3, 40]
    with torch.inference_mode():
        model(*_prompts(seq_lens, bs))  # every row's context in its blocks
        # one prompt filling its bucket, one with pad tokens, a tiny one (decode launch), mixed steps with decodes
        for counts in ([64], [100], [3], [1, 30, 1], [1, 1, 5, 2, 1, 1], [16, 1, 1, 1, 3, 9]):
            lens = seq_lens[: len(counts)]
            step = _step(counts, lens, bs)
            width = step.attn_metadata.block_tables.shape[1]
            eager = model.compute_logits(model(step.input_ids, step.positions, step.attn_metadata))
            assert graphs.key_for(counts, width) is None and graphs.prefill_key_for(counts, width) is not None
            replayed = model.compute_logits(graphs.run(step, counts))
            tol = 1e-4 if dtype == "float32" else 2e-2
            torch.testing.assert_close(replayed, eager, rtol=tol, atol=tol)


def _prompts(seq_lens: list[int], bs: int):
    step = _step(list(seq_lens), seq_lens, bs)
    return step.input_ids, step.positions, step.attn_metadata


@pytest.mark.parametrize("quantization,kv_cache_dtype", [(None, "auto"), ("fp8", "fp8")])
def test_greedy_with_prefill_graphs_equals_enforce_eager(checkpoint: Path, quantization: str | None,
                                                        kv_cache_dtype: str) -> None:
    """Prompts of 5 .. 110 tokens under a 64-token step budget (prefill chunks sharing steps with decodes): the
    same greedy tokens as enforce_eager, with prefill and mixed steps replayed in the prefill graphs."""
    kwargs = dict(dtype="bfloat16", quantization=quantization, kv_cache_dtype=kv_cache_dtype, max_model_len=256,
                  max_num_seqs=8, max_num_batched_tokens=64, device="cuda")
    g = torch.Generator().manual_seed(7)
    batch = [{"prompt_token_ids": torch.randint(3, 200, (n,), generator=g).tolist()} for n in (5, 17, 40, 110, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    eager = LLM(str(checkpoint), enforce_eager=True, **kwargs)
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    graphs = LLM(str(checkpoint), max_prefill_graph_tokens=64, graph_capture="startup", **kwargs)
    graph_runner = graphs.runner.graph_runner
    replayed = record_replays(graph_runner, "_replay_prefill")
    got = [o.outputs[0].token_ids for o in graphs.generate(batch, params, use_tqdm=False)]
    assert got == expected
    assert len(replayed) >= 4 and any(rows > 2 for _, rows in replayed)
    # The one-prompt case the issue measures: a fresh (no prefix-cache hit) 64-token prompt at batch 1, prefilled
    # in one replay.
    replayed.clear()
    single = [{"prompt_token_ids": torch.randint(3, 200, (64,), generator=g).tolist()}]
    assert ([o.outputs[0].token_ids for o in graphs.generate(single, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in eager.generate(single, params, use_tqdm=False)])
    assert replayed == [(64, 2)]


def test_moe_model_captures_and_replays_prefill_graphs_by_default(moe_checkpoint: Path) -> None:
    """An MoE model with the default graphs (captured while it serves, the largest token count first): capture runs
    route real values (every token of the capture-time step belongs to the pad row, so no expert id comes from stale
    memory), and greedy equals enforce_eager."""
    kwargs = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, device="cuda")
    g = torch.Generator().manual_seed(9)
    batch = [{"prompt_token_ids": torch.randint(3, 200, (n,), generator=g).tolist()} for n in (5, 40, 110)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eager = LLM(str(moe_checkpoint), enforce_eager=True, **kwargs)
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    graphs = LLM(str(moe_checkpoint), **kwargs)
    assert graphs.runner.graph_capture == "serving" and graphs.runner.graph_runner is not None
    assert [o.outputs[0].token_ids for o in graphs.generate(batch, params, use_tqdm=False)] == expected
    assert graphs.runner.graph_runner.prefill_graphs  # captured between its steps
