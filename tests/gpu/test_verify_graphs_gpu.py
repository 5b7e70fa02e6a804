"""GPU-only: verify steps (rows of up to k + 1 query tokens) replayed in CUDA graphs give the eager forward's
logits, padded rows and rows shorter than the graph's query length included; speculation with graphs on is
lossless (skipped on CPU). Run on the H200: `.venv/bin/python -m pytest -q tests/gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.input_batch import ModelInputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verify-graphs")
    write_tiny_checkpoint(path, arch="llama", seed=3)
    return path


def _step(counts: list[int], seq_lens: list[int], block_size: int, device: str) -> ModelInputs:
    """Rows r own blocks 8r .. 8r + 7; each scores its last counts[r] positions."""
    g = torch.Generator().manual_seed(sum(seq_lens))
    ids, positions, slots, starts = [], [], [], [0]
    for row, (count, seq_len) in enumerate(zip(counts, seq_lens)):
        for p in range(seq_len - count, seq_len):
            positions.append(p)
            slots.append((8 * row + p // block_size) * block_size + p % block_size)
        ids += torch.randint(3, 200, (count,), generator=g).tolist()
        starts.append(starts[-1] + count)
    table = torch.tensor([[8 * r + b for b in range(8)] for r in range(len(counts))], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots, device=device), torch.tensor(starts, dtype=torch.int32, device=device),
                             torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(device),
                             max(counts), max(seq_lens))
    return ModelInputs(torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta,
                       torch.tensor([s - 1 for s in starts[1:]], device=device), list(range(len(counts))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_graph_logits_match_eager(checkpoint: Path, dtype: str) -> None:
    llm = LLM(str(checkpoint), dtype=dtype, max_model_len=128, max_num_seqs=8, device="cuda",
              kv_cache_blocks=64, speculative_config=NGRAM, graph_capture="startup")  # every graph, before the steps
    runner = llm.runner
    graphs = runner.graph_runner
    assert graphs is not None and graphs.verify_query_lens == [2, 3, 4, 5] and graphs.verify_sizes == [1, 2, 4, 8]
    model, bs = runner.model, runner.block_size
    seq_lens = [40, 70, 5, 100, 3]
    with torch.inference_mode():
        model(*_prefill(seq_lens, bs))  # every row's context in its blocks
        for counts in ([5], [3], [1, 5, 2], [2, 2, 2, 2, 2], [1, 1, 4, 3, 1]):
            lens = seq_lens[: len(counts)]
            step = _step(counts, lens, bs, "cuda")
            eager = model.compute_logits(model(step.input_ids, step.positions, step.attn_metadata))
            assert graphs.can_run(counts, step.attn_metadata.block_tables.shape[1])
            replayed = model.compute_logits(graphs.run(step, counts))
            tol = 1e-4 if dtype == "float32" else 2e-2
            torch.testing.assert_close(replayed, eager, rtol=tol, atol=tol)


def _prefill(seq_lens: list[int], bs: int):
    step = _step(list(seq_lens), seq_lens, bs, "cuda")
    return step.input_ids, step.positions, step.attn_metadata


def test_speculation_with_verify_graphs_is_lossless(checkpoint: Path) -> None:
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * (3 + i)} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=128, max_num_seqs=8, device="cuda")
    plain = LLM(str(checkpoint), enforce_eager=True, **kwargs).generate(prompts, params, use_tqdm=False)
    spec = LLM(str(checkpoint), speculative_config=NGRAM, **kwargs)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert spec.stats.num_spec_accepted_tokens > 0


@pytest.mark.parametrize("proposer", ["self", "head"])
def test_worker_proposers_with_graphs_are_lossless(checkpoint: Path, tmp_path: Path, proposer: str) -> None:
    """A draft model (the target drafting for itself: every draft accepted) and a random EAGLE head, their
    catch-up and proposal steps in CUDA graphs: greedy outputs equal the eager run without speculation."""
    import json

    from kestrel.loader.model_init import write_eagle_head

    model = str(checkpoint)
    if proposer == "head":
        write_eagle_head(tmp_path, json.loads((checkpoint / "config.json").read_text()), seed=1)
        model = str(tmp_path)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * (3 + i)} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=128, max_num_seqs=8, device="cuda")
    plain = LLM(str(checkpoint), enforce_eager=True, **kwargs).generate(prompts, params, use_tqdm=False)
    spec = LLM(str(checkpoint), speculative_config={"model": model, "num_speculative_tokens": 3}, **kwargs)
    assert spec.runner.drafter.graph_runner is not None
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    if proposer == "self":
        assert spec.stats.num_spec_accepted_tokens == spec.stats.num_spec_draft_tokens > 0
