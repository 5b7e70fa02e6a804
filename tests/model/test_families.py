"""Every decoder family against Hugging Face transformers, on tiny random checkpoints that transformers itself
writes: float32 logits of a flat batch and of chunked prefill + decode within 1e-4, greedy tokens identical
under chunked prefill, prefix caching and preemption, and W8A8 (FP8, INT8) logits within the quantized tests'
bound."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_hf_parity import PagedBatch, assert_rel_close, hf_logits, random_prompts
from test_quantized import CONFIGS as W8A8_CONFIGS
from test_quantized import cosine_bound, last_logits

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError, ModelConfig
from kestrel.loader import load_model
from kestrel.loader.tokenizer_init import write_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 256
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
# family -> (transformers config class, model class, config entries on top of SHAPE)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3-window": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "use_sliding_window": True,
                                                         "sliding_window": 8, "max_window_layers": 1}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    # Small caps, so that the tiny model's scores and logits reach them.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                                                     "attn_logit_softcapping": 1.5, "final_logit_softcapping": 4.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "phi3-partial-window": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 8, "partial_rotary_factor": 0.5}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 4.0, "attention_multiplier": 0.2,
                                                        "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16, "rms_norm_eps": 1e-5}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": 8,
                                                        "logit_scale": 0.5}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 8}),
    # Mixtures of experts: 4 experts, 2 a token.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [1]}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True}),
    # Every second layer sparse (decoder_sparse_step): the first layer keeps its dense MLP.
    "qwen3-moe-sparse-step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 2}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                                  "clip_qkv": 0.5}),
}
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe", "qwen3-moe-sparse-step", "olmoe")


def write_family(path: Path, family: str, seed: int = 0, spread: float = 0.08) -> Path:
    """A random checkpoint of `family` written by transformers (weights of std `spread`, by default wider than
    its initializer's 0.02, and norms moved off their neutral value by 2.5 times that, so that every block shows
    in the logits), with kestrel's tokenizer."""
    config_cls, model_cls, entries = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SHAPE, **entries}, bos_token_id=1, eos_token_id=2,
                                               pad_token_id=0)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 2.5 * spread)
            else:
                param.normal_(0.0, spread)
    model.save_pretrained(str(path))
    write_tokenizer(str(path), vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = write_family(tmp_path_factory.mktemp(request.param), request.param)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                                 dtype=torch.float32).eval()
    return request.param, path, hf_model


def test_flat_batch_chunked_prefill_and_decode_match_transformers(family) -> None:
    _, path, hf_model = family
    model = load_model(ModelConfig(model=str(path), dtype="float32"))
    prompts = random_prompts(VOCAB, [5, 29, 12, 1, 40])
    for tokens, ours in zip(prompts, PagedBatch(model, len(prompts)).step(prompts, [(0, len(p)) for p in prompts])):
        assert_rel_close(ours, hf_logits(hf_model, tokens))
    # Chunks of each prompt, one sequence decoding meanwhile, then one decode step for all.
    batch, tokens = PagedBatch(model, len(prompts)), [list(p) for p in prompts]
    outputs: list[list[torch.Tensor]] = [[] for _ in prompts]
    first = [len(p) if len(p) <= 5 else len(p) // 2 + 3 for p in prompts]
    for ranges in ([(0, n) for n in first], [(n, len(t)) for n, t in zip(first, tokens)]):
        for s, (chunk, (_, end)) in enumerate(zip(batch.step(tokens, ranges), ranges)):
            outputs[s].append(chunk)
            if end == len(tokens[s]):
                tokens[s].append(int(chunk[-1].argmax()))
    for s, chunk in enumerate(batch.step(tokens, [(len(t) - 1, len(t)) for t in tokens])):
        outputs[s].append(chunk)
    for s, seq in enumerate(tokens):
        ours = torch.cat(outputs[s])
        assert_rel_close(ours, hf_logits(hf_model, seq)[: ours.shape[0]])


def hf_greedy(hf_model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def test_greedy_matches_transformers_under_chunking_prefix_caching_and_preemption(family) -> None:
    """Shared 20-token prefixes (prefix-cache hits), 8-token prefill chunks, and too few KV blocks for all."""
    _, path, hf_model = family
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 24))]
               for i in range(8)]
    expected = hf_greedy(hf_model, prompts, 12)
    llm = LLM(str(path), dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=8,
              kv_cache_blocks=7)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)  # fills the prefix cache
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == expected[1]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # Layers that all slide give back blocks outside their window, so they may need no preemption.
    if any(layer.sliding_window is None for layer in llm.runner.model.attention_layers()):
        assert llm.stats.num_preemptions > 0
    assert sum(o.num_cached_tokens or 0 for o in outputs) >= 16


@pytest.fixture(scope="module")
def initialized(family, tmp_path_factory):
    """The family at its initializer's scale (std 0.02), as the W8A8 tests' error bound assumes."""
    name = family[0]
    path = write_family(tmp_path_factory.mktemp(f"{name}-init"), name, seed=1, spread=0.02)
    return path, transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("method", ["fp8", "int8-asym"])
def test_w8a8_logits_stay_close(family, initialized, method: str) -> None:
    path, hf_model = initialized
    config = W8A8_CONFIGS[method]
    if family[0] in MOE_FAMILIES and config.method == "int8":
        pytest.skip("no INT8 kernel for experts: test_int8_experts_are_refused_naming_the_layer")
    model = load_model(ModelConfig(model=str(path), dtype="float32"), config)
    prompts = random_prompts(VOCAB, [7, 19, 33], seed=2)
    reference = torch.stack([hf_logits(hf_model, p)[-1] for p in prompts])
    cos = F.cosine_similarity(last_logits(model, prompts).double(), reference.double(), dim=-1)
    # The quantized tests' bound assumes every GEMM input has absmax <= 3 x rms; the post-norm stream (OLMo 2) and
    # the q/k norms' gains give some families heavier tails, which one more layer's error budget covers.
    assert cos.min() >= cosine_bound(config.method, model.config.num_layers + 1), cos.tolist()


@pytest.mark.parametrize(("family_name", "entries", "field"), [
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("cohere", {"use_qk_norm": True}, "use_qk_norm"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ("phi3", {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope"),
])
def test_unsupported_config_fields_are_named(tmp_path: Path, family_name: str, entries: dict, field: str) -> None:
    import json

    path = write_family(tmp_path, family_name)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **entries}))
    with pytest.raises(ConfigError, match=field):
        load_model(ModelConfig(model=str(path), dtype="float32"))


def test_gemma3_vision_language_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration as transformers writes it (language_model.* names, a vision tower, a
    config.json whose decoder lives in text_config): kestrel's logits on text match the whole model's."""
    text = transformers.Gemma3TextConfig(**{**SHAPE, "vocab_size": VOCAB + 8}, head_dim=16, sliding_window=8)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, boi_token_index=VOCAB + 5, eoi_token_index=VOCAB + 6,
                                       image_token_index=VOCAB + 7)
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    hf_model.save_pretrained(str(tmp_path))
    model = load_model(ModelConfig(model=str(tmp_path), dtype="float32"))
    assert model.config.num_layers == 2 and model.config.vocab_size == VOCAB + 8
    prompts = random_prompts(VOCAB, [6, 21])
    for tokens, ours in zip(prompts, PagedBatch(model, 2).step(prompts, [(0, len(p)) for p in prompts])):
        assert_rel_close(ours, hf_logits(hf_model, tokens))


def test_readme_and_models_doc_list_every_registered_architecture() -> None:
    from kestrel.model.registry import supported_architectures

    root = Path(__file__).resolve().parents[2]
    readme, models = (root / "README.md").read_text(), (root / "docs" / "models.md").read_text()
    for name in supported_architectures():
        assert f"`{name}`" in readme and f"`{name}`" in models, name


def test_int8_experts_are_refused_naming_the_layer(tmp_path: Path) -> None:
    path = write_family(tmp_path, "qwen3-moe")
    with pytest.raises(ConfigError, match=r"experts of 'model\.layers\.0\.mlp\.experts' to INT8"):
        load_model(ModelConfig(model=str(path), dtype="float32"), W8A8_CONFIGS["int8-asym"])
