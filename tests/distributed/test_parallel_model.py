"""The sharded model against the one-process model: logits of a paged prefill, a chunked continuation and a
decode step, for tiny random checkpoints of the families whose layers shard differently, float32 and W8A8 (INT8
sym/asym, FP8, quantized at load), under TP = 4 (kv heads replicated: 2 kv heads on 4 ranks) and TP = 2 x PP = 2.

One group of 4 gloo processes is spawned for the module; each rank writes its logits to a file that the test
compares with the oracle computed here in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks

from kestrel.config import ModelConfig, QuantConfig
from kestrel.distributed.parallel import init_parallel, shutdown_parallel
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.stage_transport import run_model

BLOCK = 16
LAYOUTS = ((4, 1, False), (2, 2, False), (4, 1, True))  # (tp, pp, expert parallel)
# The families whose layers shard differently: merged checkpoint tensors split by shard (phi3), interleaved RoPE
# rows reordered before the rank's slice (glm4), RMSNorms over all q or k heads summed over the group (olmo2),
# sandwich norms, soft caps and windows (gemma2), a parallel block with RoPE-less global layers (cohere2), a
# plain MLP under LayerNorms with bias (starcoder2); experts with their intermediate dimension split, a shared
# expert and a dense layer (qwen2_moe).
ARCHS = ("llama", "mistral", "qwen2", "phi3", "glm4", "olmo2", "gemma2", "cohere2", "starcoder2", "qwen2_moe")
QUANTS = {"float32": None, "int8": QuantConfig(method="int8"), "fp8": QuantConfig(method="fp8"),
          "int8-asym": QuantConfig(method="int8", symmetric_activations=False)}
# Which (arch, quant) pairs run: every arch in float32, every quantization on one arch or another.
CASES = [(arch, "float32") for arch in ARCHS] + [("llama", "int8"), ("qwen2", "fp8"), ("mistral", "int8-asym"),
                                                 ("phi3", "fp8"), ("olmo2", "int8")]
STEPS = [  # per step, each sequence's (start, end) of its tokens; the prompts are 21 and 9 tokens long
    [(0, 12), (0, 9)],  # prefill, the first one chunked
    [(12, 21), (9, 10)],  # the rest of the chunk, a decode
    [(21, 22), (10, 11)],  # decodes
]
TIMEOUT_S = 120
MOE_ARCHS = ("qwen2_moe", "mixtral")


def cases_of(expert_parallel: bool) -> list[tuple[str, str]]:
    """Every case, or under expert parallelism the mixtures of experts (4 experts: one a rank)."""
    return [(arch, "float32") for arch in MOE_ARCHS] if expert_parallel else CASES


def layout_name(tp: int, pp: int, ep: bool) -> str:
    return f"tp{tp}-pp{pp}" + ("-ep" if ep else "")



def tokens_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (22, 11)]


def run_steps(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    """Every step's logits, concatenated; each sequence owns blocks 1-2 / 3-4 of the paged cache."""
    for layer in model.attention_layers():
        layer.bind_kv_cache(torch.zeros(2, 5, BLOCK, layer.num_kv_heads, layer.head_size))
    tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    tokens, out = tokens_for(vocab), []
    for ranges in STEPS:
        ids, pos, slots, lens = [], [], [], []
        for s, (a, b) in enumerate(ranges):
            ids += tokens[s][a:b]
            pos += list(range(a, b))
            slots += [int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK for p in range(a, b)]
            lens.append(b - a)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=tables,
            query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor([b for _, b in ranges], dtype=torch.int32),
            max_query_len=max(lens), max_seq_len=max(b for _, b in ranges))
        with torch.no_grad():
            hidden = run_model(model, model.parallel, torch.tensor(ids), torch.tensor(pos), meta)
            if model.parallel.is_last_stage:  # an earlier stage has no LM head: it sent its hidden states on
                out.append(model.compute_logits(hidden))
    return torch.cat(out) if out else torch.empty(0)


def load(path: Path, quant: str, parallel=None) -> torch.nn.Module:
    return load_model(ModelConfig(model=str(path), dtype="float32"), QUANTS[quant], "cpu", parallel)


def rank_main(rank: int, ports: list[int], root: str) -> None:
    torch.set_num_threads(1)
    for (tp, pp, ep), port in zip(LAYOUTS, ports):
        parallel = init_parallel(rank, tp, pp, f"tcp://127.0.0.1:{port}", "gloo", TIMEOUT_S, ep)
        try:
            for arch, quant in cases_of(ep):
                model = load(Path(root) / arch, quant, parallel)
                logits = run_steps(model, model.config.vocab_size)
                torch.save(logits, Path(root) / f"{arch}-{quant}-{layout_name(tp, pp, ep)}-rank{rank}.pt")
        finally:
            shutdown_parallel()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp-model")
    for arch in {*ARCHS, *MOE_ARCHS}:
        write_tiny_checkpoint(root / arch, arch, seed=3)
    run_ranks(rank_main, 4, len(LAYOUTS), root, TIMEOUT_S)
    return root


@pytest.mark.parametrize(("arch", "quant", "tp", "pp", "ep"),
                         [(a, q, tp, pp, ep) for tp, pp, ep in LAYOUTS for a, q in cases_of(ep)])
def test_sharded_logits_match_one_process(results: Path, arch: str, quant: str, tp: int, pp: int, ep: bool) -> None:
    model = load(results / arch, quant)
    oracle = run_steps(model, model.config.vocab_size)
    for rank in range((pp - 1) * tp, pp * tp):
        # Every rank of the last stage ends with the whole vocabulary's logits (gathered over tp).
        ours = torch.load(results / f"{arch}-{quant}-{layout_name(tp, pp, ep)}-rank{rank}.pt")
        assert ours.shape == oracle.shape
        torch.testing.assert_close(ours, oracle, rtol=0, atol=1e-5)
        assert torch.equal(ours.argmax(-1), oracle.argmax(-1))
