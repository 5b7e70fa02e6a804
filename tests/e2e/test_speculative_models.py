"""Speculative decoding with worker-side proposers (a draft model, an EAGLE-style head) is lossless: greedy outputs
equal decoding without speculation (random checkpoints, float32) under chunked prefill, preemption, async
scheduling, prefix caching and n > 1. The target used as its own draft model proposes exactly what the target
then emits, so every draft must be accepted: any stale draft K/V (a prefix-cache hit, a preemption, a step
that skipped the drafter) would show as a rejection. EAGLE proposals equal a recomputation of the head over the
whole context."""

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError, EngineConfig
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.attn_metadata import AttentionMetadata

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8] * (3 + i) + [9] * (5 * i)} for i in range(4)] * 2
# Chunked prompts (16-token budget), a KV cache too small for the batch (preemptions), prefix-cache hits (each
# prompt twice, n = 2), async scheduling with speculation off above 3 running requests.
STRESS = dict(kv_cache_blocks=10, max_num_batched_tokens=16, max_num_seqs=8, async_scheduling=True,
              enable_prefix_caching=True)


def run(llm, prompts=PROMPTS, n=2, max_tokens=40):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(spec_models):
    return run(LLM(spec_models["target"], dtype="float32", max_model_len=128))


@pytest.mark.parametrize("proposer", ["target", "draft", "head"])
def test_lossless_under_chunking_preemption_async_prefix_caching_and_n(spec_models, plain, proposer):
    spec = {"model": spec_models[proposer], "num_speculative_tokens": 3, "disable_by_batch_size": 3}
    llm = LLM(spec_models["target"], dtype="float32", max_model_len=128, speculative_config=spec, **STRESS)
    assert llm.config.speculative.method == ("eagle" if proposer == "head" else "draft_model")
    assert run(llm) == plain
    stats, kv = llm.stats, llm.engine.scheduler.kv
    assert stats.num_preemptions > 0 and kv.prefix_hits > 0 and stats.num_spec_draft_tokens > 0
    assert kv.pool.num_free_blocks == 10 and not llm.runner.requests
    if proposer == "target":
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens  # its own drafts: all accepted
        assert stats.spec_accepted_per_position[0] == stats.num_spec_drafts


def test_draft_blocks_share_the_kv_budget(spec_models):
    """The blocks hold both models' K/V: a memory budget buys fewer blocks with a draft model."""
    budget = dict(cpu_kv_cache_bytes=1 << 20, max_model_len=128, dtype="float32", max_num_seqs=64)
    alone = LLM(spec_models["target"], **budget).runner
    both = LLM(spec_models["target"], speculative_config={"model": spec_models["draft"]}, **budget).runner
    per_block = alone.kv_spec.bytes_per_block + both.drafter.kv_spec.bytes_per_block
    assert alone.num_blocks == (1 << 20) // alone.kv_spec.bytes_per_block
    assert both.num_blocks == (1 << 20) // per_block
    assert both.drafter.kv_caches[0].shape[1] == both.num_blocks


def test_eagle_proposals_equal_a_recomputation_over_the_whole_context(spec_models, record_proposals):
    """Each proposal of the head (fed the target's hidden states chunk by chunk, its own outputs while drafting,
    K/V in the shared blocks) equals the head run over the whole context at once, then greedily k steps."""
    spec = {"model": spec_models["head"], "num_speculative_tokens": 3}
    llm = LLM(spec_models["target"], dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=False, speculative_config=spec)
    recorded = record_proposals(llm.runner)
    run(llm, PROMPTS[:3], n=1, max_tokens=12)
    assert len(recorded) >= 30
    for tokens, drafts in recorded[::3]:
        assert drafts == _recompute_head(llm.runner, tokens, 3)


def _recompute_head(runner, tokens, k):
    target, head, embed = runner.model, runner.drafter.model, runner.model.model.embed_tokens
    n = len(tokens)
    blocks = -(-(n + k) // runner.block_size)

    def meta(start, end):
        return AttentionMetadata(torch.arange(start, end), torch.tensor([0, end - start], dtype=torch.int32),
                                 torch.tensor([end], dtype=torch.int32),
                                 torch.arange(blocks, dtype=torch.int32).unsqueeze(0), end - start, end)

    for model in (target, head):  # fresh caches: blocks 0.. in order
        for layer in model.attention_layers():
            layer.bind_kv_cache(torch.zeros(2, blocks, runner.block_size, *layer.kv_cache.shape[3:]))
    with torch.inference_mode():
        ids = torch.tensor(tokens)
        hidden = target(ids[:-1], torch.arange(n - 1), meta(0, n - 1))
        features = torch.cat([torch.zeros(1, hidden.shape[1]), hidden])
        out = head(ids, features, torch.arange(n), meta(0, n), embed)[-1:]
        drafts = []
        for j in range(k):
            drafts.append(int(target.compute_logits(out).argmax(-1)))
            if j + 1 < k:
                pos = n + j
                out = head(torch.tensor(drafts[-1:]), out, torch.tensor([pos]), meta(pos, pos + 1), embed)
    return drafts


def test_config_checks_name_the_field(spec_models, tmp_path):
    target = spec_models["target"]

    def config(spec, **kw):
        return EngineConfig.from_kwargs(target, speculative_config=spec, **kw)

    assert config({"model": spec_models["draft"]}).speculative.method == "draft_model"
    assert config({"model": spec_models["head"]}).speculative.method == "eagle"
    assert config({}).speculative.method == "ngram"
    write_tiny_checkpoint(tmp_path / "other-vocab", seed=1, vocab_size=2048)
    cases = [
        ({"model": str(tmp_path / "other-vocab")}, {}, "vocab_size"),
        ({"method": "ngram", "model": spec_models["draft"]}, {}, "speculative_config.model"),
        ({"method": "draft_model"}, {}, "speculative_config.model"),
        ({"method": "eagle", "model": spec_models["draft"]}, {}, "EAGLE-style head"),
        ({"method": "draft_model", "model": spec_models["head"]}, {}, "method 'eagle'"),
        ({"model": spec_models["draft"], "prompt_lookup_max": 3}, {}, "speculative_config.prompt_lookup_max"),
        ({"method": "eagle3", "model": spec_models["head"]}, {}, "speculative_config.method"),
        ({"model": spec_models["draft"], "quantization": "fp8"}, {}, "unknown keys ['quantization']"),
        ({"model": spec_models["draft"]}, {"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"model": str(tmp_path / "missing")}, {}, "speculative_config.model"),
    ]
    for spec, kw, message in cases:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            config(spec, **kw)
