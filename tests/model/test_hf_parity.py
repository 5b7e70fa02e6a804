"""Logits of kestrel's Llama family against Hugging Face transformers on tiny random checkpoints (float32).

Batches are flat (several prompts of different lengths in one forward) over a paged KV cache whose
AttentionMetadata is built here by hand, with each sequence owning a contiguous run of blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.config import ConfigError, ModelConfig
from kestrel.loader import load_model
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.loader.safetensors import CheckpointNotFoundError
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.rotary import RopeConfig, compute_inv_freq
from kestrel.model.loading import WeightLoadingError
from kestrel.model.registry import get_model_class

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 4
REL_TOL = 1e-4

# name -> (arch, config overrides)
CASES = {
    "llama3": ("llama", {}),  # llama3 rope scaling, untied
    "llama2-tied": ("llama", {"rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": True}),
    "mistral-window8": ("mistral", {"sliding_window": 8}),
    "qwen2-tied": ("qwen2", {}),
    "qwen2-untied-window": ("qwen2", {"tie_word_embeddings": False, "use_sliding_window": True,
                                      "sliding_window": 8, "max_window_layers": 1}),
}
PROMPT_LENS = [5, 29, 12, 1, 40]


class PagedBatch:
    """The runner's job in miniature: sequences own blocks; a step schedules a token range of each."""

    def __init__(self, model: torch.nn.Module, num_seqs: int) -> None:
        num_blocks = num_seqs * BLOCKS_PER_SEQ + 1
        for layer in model.attention_layers():
            layer.bind_kv_cache(torch.zeros(2, num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size))
        # Block 0 stays unused, so a read of padding entries would show up as a mismatch.
        self.block_tables = torch.arange(1, num_blocks, dtype=torch.int32).view(num_seqs, BLOCKS_PER_SEQ)
        self.model = model

    def step(self, tokens: list[list[int]], ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Run tokens[s][start:end] for each (start, end) in `ranges`; return each sequence's logits."""
        input_ids, positions, slots, query_lens = [], [], [], []
        for s, (start, end) in enumerate(ranges):
            input_ids += tokens[s][start:end]
            for p in range(start, end):
                positions.append(p)
                slots.append(int(self.block_tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
            query_lens.append(end - start)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor([end for _, end in ranges], dtype=torch.int32),
            block_tables=self.block_tables,
            max_query_len=max(query_lens),
            max_seq_len=max(end for _, end in ranges),
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), metadata)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([tokens])).logits[0].float()


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < REL_TOL, f"relative error {rel:.2e}"


def load(path: Path, **kwargs) -> torch.nn.Module:
    return load_model(ModelConfig(model=str(path), **kwargs))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(path, arch=arch, seed=1, **overrides)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    return request.param, path, load(path), hf_model


def test_flat_batch_prefill_matches_hf(pair) -> None:
    _, _, model, hf_model = pair
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENS)
    logits = PagedBatch(model, len(prompts)).step(prompts, [(0, len(p)) for p in prompts])
    for tokens, ours in zip(prompts, logits):
        assert_rel_close(ours, hf_logits(hf_model, tokens))


def test_chunked_prefill_and_decode_match_hf(pair) -> None:
    """Step 1: first chunks. Step 2: the rest, with one sequence already decoding. Step 3: all decode."""
    _, _, model, hf_model = pair
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENS, seed=1)
    batch = PagedBatch(model, len(prompts))
    first = [len(p) if len(p) <= 5 else len(p) // 2 + 3 for p in prompts]
    tokens = [list(p) for p in prompts]
    outputs: list[list[torch.Tensor]] = [[] for _ in prompts]

    def run(ranges: list[tuple[int, int]]) -> None:
        for s, (chunk, (_, end)) in enumerate(zip(batch.step(tokens, ranges), ranges)):
            outputs[s].append(chunk)
            if end == len(tokens[s]):
                tokens[s].append(int(chunk[-1].argmax()))

    run([(0, n) for n in first])
    run([(n, len(t)) for n, t in zip(first, tokens)])
    run([(len(t) - 1, len(t)) for t in tokens])
    for s, seq in enumerate(tokens):
        ours = torch.cat(outputs[s])
        ref = hf_logits(hf_model, seq)
        # The last sampled token has not been fed back yet: compare every position that ran.
        assert_rel_close(ours, ref[: ours.shape[0]])


def test_sliding_window_is_exercised(pair) -> None:
    """Guards the parity tests: where a window is configured, dropping it changes the logits."""
    name, _, model, _ = pair
    windows = [layer.sliding_window for layer in model.attention_layers()]
    if all(w is None for w in windows):
        pytest.skip("no sliding window in this configuration")
    if name.startswith("qwen2"):
        assert windows[0] is None and windows[1] == 8  # only layers >= max_window_layers
    prompts = random_prompts(model.config.vocab_size, [40])
    windowed = PagedBatch(model, 1).step(prompts, [(0, 40)])[0]
    try:
        for layer in model.attention_layers():
            layer.sliding_window = None
        full = PagedBatch(model, 1).step(prompts, [(0, 40)])[0]
    finally:
        for layer, w in zip(model.attention_layers(), windows):
            layer.sliding_window = w
    assert (windowed - full).abs().max() > 1e-4


def test_llama3_rope_frequencies_match_hf(tmp_path: Path) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    write_tiny_checkpoint(tmp_path, arch="llama")
    model = load(tmp_path)
    rotary = model.model.layers[0].self_attn.rotary_emb
    hf_config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    positions = torch.arange(rotary.max_position, dtype=torch.float32)
    expected = torch.outer(positions, inv_freq.float())
    torch.testing.assert_close(rotary.cos_cache, expected.cos())
    unscaled = compute_inv_freq(rotary.rotary_dim, RopeConfig(theta=hf_config.rope_parameters["rope_theta"]), 512)
    assert not torch.allclose(inv_freq, unscaled)  # the scaling is not a no-op at this size


def test_tied_embeddings_share_one_parameter(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, arch="qwen2")
    model = load(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_tied_checkpoint_with_redundant_lm_head_loads(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, arch="llama", tie_word_embeddings=True)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(tmp_path / "model.safetensors"))
    model = load(tmp_path)
    torch.testing.assert_close(model.lm_head.weight, weights["model.embed_tokens.weight"])


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path / "single", arch="mistral", seed=3)
    write_tiny_checkpoint(tmp_path / "sharded", arch="mistral", seed=3, num_shards=2)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 2
    single, sharded = load(tmp_path / "single"), load(tmp_path / "sharded")
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def _rewrite(path: Path, edit) -> None:
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, arch="llama")
    _rewrite(tmp_path, lambda w: w.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(WeightLoadingError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.v_proj\.weight"):
        load(tmp_path)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, arch="qwen2")
    name = "model.layers.0.self_attn.k_proj.bias"

    def widen(w: dict) -> None:
        w[name] = torch.zeros(33)

    _rewrite(tmp_path, widen)
    with pytest.raises(WeightLoadingError, match=r"k_proj\.bias.*\(33,\).*\(32,\)"):
        load(tmp_path)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, arch="llama")
    _rewrite(tmp_path, lambda w: w.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightLoadingError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load(tmp_path)


def test_unknown_architecture_lists_supported_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM.*LlamaForCausalLM.*MistralForCausalLM.*Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    write_tiny_checkpoint(tmp_path, arch="llama", architectures=["FalconForCausalLM"])
    with pytest.raises(ConfigError, match="FalconForCausalLM.*supported: .*LlamaForCausalLM"):
        load(tmp_path)


def test_no_weights_is_a_clear_error(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, arch="llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no \\*.safetensors weights.*load_format='dummy'"):
        load(tmp_path)


def test_dummy_weights_are_seeded_and_finite(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, arch="qwen2")
    (tmp_path / "model.safetensors").unlink()
    a = load(tmp_path, load_format="dummy", seed=7)
    b = load(tmp_path, load_format="dummy", seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    logits = PagedBatch(a, 2).step(random_prompts(a.config.vocab_size, [9, 3]), [(0, 9), (0, 3)])
    assert all(torch.isfinite(x).all() and x.std() > 0 for x in logits)


def test_dtype_auto_follows_checkpoint(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, arch="llama", torch_dtype="bfloat16")
    assert load(tmp_path).model.embed_tokens.weight.dtype == torch.bfloat16
    assert load(tmp_path, dtype="float32").model.embed_tokens.weight.dtype == torch.float32


def test_forward_without_kv_cache_is_a_clear_error(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, arch="llama")
    model = load(tmp_path)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(3), query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32), block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=3, max_seq_len=3,
    )
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), metadata)
