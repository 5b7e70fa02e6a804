"""Quest sparse decoding through the engine on kestrel-tiny: configuration errors and the CLI flag, the key bounds
every step reads (chunked prefill, decode, block reuse, prefix-cache hits; FP32 and FP8 caches), greedy identity
with dense attention when the budget covers the context, and a small budget that runs sparse and stays close."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel import ops as kestrel_ops
from kestrel.config import ConfigError, EngineConfig
from kestrel.entrypoints.cli import _engine_kwargs, build_parser
from kestrel.kernels.sparse_decode import stored_bound
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.layers.attention import Attention
from kestrel.tiny import corpus, default_model_path

BLOCK = 16


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(default_model_path())


@pytest.fixture(scope="module")
def held_out_ids(tiny) -> list[int]:
    """~420 tokens of a held-out stdlib file (no special tokens)."""
    from kestrel.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny)
    text = "".join(corpus.texts(corpus.select_evenly(corpus.eval_files(), 4)))
    return tokenizer(text[:6000], add_special_tokens=False)["input_ids"][:420]


def quest(budget: int, **extra) -> dict:
    return {"method": "quest", "token_budget": budget, **extra}


def test_config_refuses_what_cannot_work(tiny, tmp_path) -> None:
    def refused(match: str, **kwargs) -> None:
        with pytest.raises(ConfigError, match=match):
            EngineConfig.from_kwargs(kwargs.pop("model", tiny), **kwargs)

    refused(r"sparse_decode.method='hash'", sparse_decode={"method": "hash", "token_budget": 128})
    refused(r"sparse_decode.method=None", sparse_decode={"token_budget": 128})
    refused(r"unknown keys \['top_k'\]", sparse_decode={**quest(128), "top_k": 3})
    refused(r"sparse_decode.token_budget=100: expected a multiple of block_size=16.*use 96 or 112",
            sparse_decode=quest(100))
    refused(r"sparse_decode.token_budget=0", sparse_decode=quest(0))
    refused(r"sparse_decode.token_budget=48: it must exceed.*use >= 64", sparse_decode=quest(48))
    refused(r"sparse_decode.recent_blocks=0: expected an integer >= 1", sparse_decode=quest(128, recent_blocks=0))
    refused(r"sparse_decode.sink_blocks=-1", sparse_decode=quest(128, sink_blocks=-1))
    refused(r"covers max_model_len=512", sparse_decode=quest(512))
    refused(r"sparse_decode.page_size=6: expected a power of two dividing block_size=16: one of \[2, 4, 8, 16\]",
            sparse_decode=quest(128, page_size=6))
    refused(r"sparse_decode.page_size=32: expected a power of two", sparse_decode=quest(128, page_size=32))
    refused(r"sparse_decode.page_size=1: expected an integer >= 2", sparse_decode=quest(128, page_size=1))
    refused(r"sparse_decode.token_budget=100: expected a multiple of page_size=8.*use 96 or 104",
            sparse_decode=quest(100, page_size=8))
    refused(r"expected a dict", sparse_decode=[128])
    mla = tmp_path / "mla"
    write_tiny_checkpoint(str(mla), arch="llama", kv_lora_rank=32)
    refused(r"latent \(MLA\) attention", model=str(mla), sparse_decode=quest(128))
    config = EngineConfig.from_kwargs(tiny, sparse_decode=quest(128, sink_blocks=0, recent_blocks=1))
    assert (config.sparse.token_budget, config.sparse.sink_blocks, config.sparse.recent_blocks) == (128, 0, 1)
    assert EngineConfig.from_kwargs(tiny).sparse is None


def test_cli_flag_is_the_config_field(tiny) -> None:
    args = build_parser().parse_args(["serve", tiny, "--sparse-decode", '{"method": "quest", "token_budget": 256}'])
    kwargs = _engine_kwargs(args)
    assert kwargs["sparse_decode"] == {"method": "quest", "token_budget": 256}
    assert EngineConfig.from_kwargs(tiny, **kwargs).sparse.num_selected_pages(BLOCK) == 16
    args = build_parser().parse_args(["serve", tiny, "--sparse-decode",
                                      '{"method": "quest", "token_budget": 256, "page_size": 8}'])
    assert EngineConfig.from_kwargs(tiny, **_engine_kwargs(args)).sparse.num_selected_pages(BLOCK) == 32


def test_models_without_full_attention_or_with_soft_caps_are_refused(tmp_path) -> None:
    windowed = tmp_path / "mistral"
    write_tiny_checkpoint(str(windowed), arch="mistral", sliding_window=32)
    with pytest.raises(ConfigError, match="no full-attention layer"):
        LLM(str(windowed), dtype="float32", max_model_len=128, sparse_decode=quest(64))
    capped = tmp_path / "gemma2"
    write_tiny_checkpoint(str(capped), arch="gemma2")
    with pytest.raises(ConfigError, match="soft-caps its attention logits"):
        LLM(str(capped), dtype="float32", max_model_len=128, sparse_decode=quest(64))


class BoundsAudit:
    """After every attention layer's forward, the key bounds of every page the step's sequences read must be
    the min / max of the keys those pages hold (the filled slots of the last one): dequantized as attention reads
    them and kept outward in bfloat16, or exact in an FP8 cache's stored units. Counts the blocks checked."""

    def __init__(self, llm: LLM) -> None:
        self.checked = 0
        self.layers = [m for m in llm.runner.model.modules() if isinstance(m, Attention)]
        self.handles = [layer.register_forward_hook(self.check) for layer in self.layers]

    def check(self, layer: Attention, args, _output) -> None:
        meta = args[3]
        tables = meta.for_group(layer.kv_group).block_tables
        k_cache = layer.kv_cache[0]
        page = BLOCK // layer.key_bounds.shape[1]
        for s, seq_len in enumerate(meta.seq_lens.tolist()):
            for lp in range(-(-seq_len // page)):
                block, start = int(tables[s, lp * page // BLOCK]), lp * page % BLOCK
                filled = min(page, seq_len - lp * page)
                keys = k_cache[block, start: start + filled]
                if k_cache.dtype == torch.float8_e4m3fn:  # an FP8 cache's bounds: its own values
                    want = torch.stack([keys.float().amin(0), keys.float().amax(0)])
                    got = layer.key_bounds[block, start // page].float()
                else:
                    keys = keys.float() * layer.k_scale
                    want = torch.stack([stored_bound(keys.amin(0), -1.0), stored_bound(keys.amax(0), 1.0)])
                    got = layer.key_bounds[block, start // page]
                assert torch.equal(got, want), (layer.layer_idx, s, lp, block)
                self.checked += 1

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("kv_cache_dtype, page_size", [("auto", None), ("fp8", None), ("fp8", 8)])
def test_bounds_hold_through_chunks_reuse_and_prefix_hits(tiny, held_out_ids, kv_cache_dtype, page_size) -> None:
    """Chunked prefill (32-token steps), decodes, a pool of 40 blocks that three waves of requests cycle through
    (freed blocks reused), and prompts sharing a 96-token prefix (prefix-cache hits, never rewritten)."""
    llm = LLM(tiny, device="cpu", max_model_len=512, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_blocks=40,
              kv_cache_dtype=kv_cache_dtype, sparse_decode=quest(64, page_size=page_size))
    audit = BoundsAudit(llm)
    prefix = held_out_ids[:96]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    try:
        for wave in range(3):
            prompts = [{"prompt_token_ids": prefix + held_out_ids[100 + 40 * (wave + i): 140 + 40 * (wave + i)]}
                       for i in range(2)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
            assert outputs[-1].num_cached_tokens >= 96 or wave == 0
    finally:
        audit.close()
    assert audit.checked > 1000


def generate(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]


def count_sparse_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = kestrel_ops.sparse_paged_decode

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(kestrel_ops, "sparse_paged_decode", counted)
    return calls


def test_budget_covering_the_context_is_greedy_identical(tiny, held_out_ids, monkeypatch) -> None:
    calls = count_sparse_calls(monkeypatch)
    bound_updates = [0]
    update = kestrel_ops.update_key_bounds

    def counted_update(*args, **kwargs):
        bound_updates[0] += 1
        return update(*args, **kwargs)

    monkeypatch.setattr(kestrel_ops, "update_key_bounds", counted_update)
    prompt = held_out_ids[:150]
    dense = generate(LLM(tiny, device="cpu", max_model_len=512), prompt, 40)
    assert bound_updates[0] == 0  # off: no bounds kept, the dense code path
    sparse = generate(LLM(tiny, device="cpu", max_model_len=512, sparse_decode=quest(256)), prompt, 40)
    assert sparse[0] == dense[0] and sparse[1] == dense[1]
    assert calls[0] == 0  # contexts of 151..190 tokens fit the 256-token budget: dense attention, bit for bit
    assert bound_updates[0] == 7 * 40  # the bounds are kept all the same: one prefill and 39 decode steps


@pytest.mark.parametrize("page_size", [None, 8])
def test_small_budget_runs_sparse_and_stays_close(tiny, held_out_ids, monkeypatch, page_size) -> None:
    """A 128-token budget over a 300-420 token context: every decode step of every layer runs Quest; the quest
    run's tokens, scored by the dense model, get logprobs close to the ones Quest gave them."""
    calls = count_sparse_calls(monkeypatch)
    prompt = held_out_ids[:300]
    tokens, sparse_logprobs = generate(LLM(tiny, device="cpu", max_model_len=512,
                                           sparse_decode=quest(128, page_size=page_size)), prompt, 48)
    layers = 7
    assert calls[0] == layers * 47  # the first token comes from the prefill
    dense = LLM(tiny, device="cpu", max_model_len=512)
    scored = dense.generate([{"prompt_token_ids": prompt + tokens}],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs
    dense_logprobs = [scored[len(prompt) + i][t].logprob for i, t in enumerate(tokens)]
    gaps = [abs(a - b) for a, b in zip(sparse_logprobs, dense_logprobs)]
    assert gaps[0] < 1e-4  # prefill: dense in both
    assert sum(gaps) / len(gaps) < 0.2, gaps  # measured: mean 0.055 nats, max 0.29 (pages of 8: 0.038, 0.21)
    assert max(gaps) > 1e-6  # the sparse path changed something


def test_dense_layers_and_the_memory_plan(tiny) -> None:
    """dense_layers leaves the first layers without bounds; the bounds' bytes come out of the KV budget (float32
    kestrel-tiny: K/V 7 x 2 x 16 x 2 x 64 x 4 = 114,688 bytes a block, bfloat16 bounds 7 x 2 x 2 x 64 x 2 = 3,584, twice
    that with pages of 8 tokens)."""
    with pytest.raises(ConfigError, match=r"sparse_decode.dense_layers=-1"):
        EngineConfig.from_kwargs(tiny, sparse_decode=quest(128, dense_layers=-1))
    with pytest.raises(ConfigError, match=r"dense_layers=7: it keeps every full-attention layer dense"):
        LLM(tiny, device="cpu", max_model_len=512, sparse_decode=quest(128, dense_layers=7))
    budget = 100 * (114_688 + 3_584)
    dense = LLM(tiny, device="cpu", max_model_len=512, kv_cache_memory_bytes=budget)
    assert dense.runner.num_blocks == budget // 114_688 and dense.runner.key_bounds == []
    sparse = LLM(tiny, device="cpu", max_model_len=512, kv_cache_memory_bytes=budget,
                 sparse_decode=quest(128, dense_layers=2))
    layers = [m for m in sparse.runner.model.modules() if isinstance(m, Attention)]
    assert [m.key_bounds is not None for m in layers] == [False, False, True, True, True, True, True]
    assert sparse.runner.num_blocks == budget // (114_688 + 5 * 2 * 2 * 64 * 2)
    assert all(b.shape == (sparse.runner.num_blocks, 1, 2, 2, 64) for b in sparse.runner.key_bounds)
    paged = LLM(tiny, device="cpu", max_model_len=512, kv_cache_memory_bytes=budget,
                sparse_decode=quest(128, dense_layers=2, page_size=8))
    assert paged.runner.num_blocks == budget // (114_688 + 5 * 2 * 2 * 2 * 64 * 2)
    assert all(b.shape == (paged.runner.num_blocks, 2, 2, 2, 64) for b in paged.runner.key_bounds)
