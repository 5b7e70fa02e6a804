"""GGUF models (llama.cpp's format) against transformers: tiny files written by gguf's own writer from a kestrel tiny
checkpoint's config and tokenizer, in F32 / F16, every quantized type kestrel runs on the weight-only kernel (Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K to Q6_K) and mixes (merged layers of two types, a float part); kestrel's
float32 logits match a transformers model holding gguf's own dequantization of the same file within 1e-4, greedy
tokens are identical through `LLM`; the tokenizer and chat template come from the metadata; split files load;
unsupported types and architectures are ConfigErrors naming them."""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import oracle_state_dict, write_gguf
from test_families import hf_greedy
from test_hf_parity import PagedBatch, assert_rel_close, hf_logits, random_prompts

from kestrel import LLM, SamplingParams
from kestrel.config import CheckpointError, ConfigError, ModelConfig
from kestrel.loader import load_model
from kestrel.loader.gguf_config import model_hf_config
from kestrel.loader.gguf_weights import blocks_of
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.quant import gguf_blocks
from kestrel.quant.schemes.gguf import GGUFLinearMethod

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

# Every K of the tiny model a multiple of 256, the K-quants' super-block.
SHAPE = {"hidden_size": 256, "intermediate_size": 512}
ARCH_OVERRIDES = {"llama": {"rope_scaling": None}, "qwen2": {}, "qwen3": {"head_dim": 64}}
# case -> (architecture, GGML type by GGUF module, what runs on the kernel)
CASES = {
    "llama-f32": ("llama", {"default": "F32"}, set()),
    # BF16 weights (float weights, loaded as they are in the model dtype), the output layer in F16.
    "qwen3-bf16": ("qwen3", {"default": "BF16", "output": "F16"}, set()),
    "llama-q8_0": ("llama", {"default": "Q8_0"}, {"Q8_0"}),
    # llama.cpp's Q4_0 files keep the output layer in Q6_K.
    "llama-q4_0": ("llama", {"default": "Q4_0", "output": "Q6_K"}, {"Q4_0"}),
    # Q4_K_M's mix: V and down projections in Q6_K (q, k in Q4_K merged with v: qkv runs as int8 in groups of 16
    # with offsets).
    "llama-q4_k_m": ("llama", {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"}, {"Q4_K", "Q6_K"}),
    "llama-q5_k": ("llama", {"default": "Q5_K", "token_embd": "Q8_0"}, {"Q5_K"}),
    # 4-bit layers in groups of 16: Q3_K (signed, no offsets), Q2_K (offsets), a merge of both.
    "llama-q3_k-q2_k": ("llama", {"default": "Q3_K", "ffn_gate": "Q2_K", "ffn_up": "Q2_K", "attn_k": "Q2_K"},
                        {"Q3_K", "Q2_K"}),
    # The legacy types with offsets and 5 bits: Q4_1 (shifted into int4), merged with Q5_0 into int8.
    "qwen2-q4_1-q5": ("qwen2", {"default": "Q4_1", "attn_v": "Q5_0", "ffn_down": "Q5_1"}, {"Q4_1", "Q5_0", "Q5_1"}),
    # Q8_0 with V in F16: qkv dequantized, the MLP and o_proj on the kernel.
    "qwen2-q8_0-mixed": ("qwen2", {"default": "Q8_0", "attn_v": "F16"}, {"Q8_0"}),
    "qwen3-q4_0": ("qwen3", {"default": "Q4_0"}, {"Q4_0"}),
}


def tiny_hf(path: Path, arch: str, **overrides) -> tuple[Path, dict]:
    config = write_tiny_checkpoint(path, arch, **SHAPE, **{**ARCH_OVERRIDES[arch], **overrides})
    return path, config


def oracle(hf_dir: Path, files: list[Path], config: dict):
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(hf_dir)),
                                                          dtype=torch.float32, attn_implementation="eager").eval()
    model.load_state_dict(oracle_state_dict(files, config), strict=not config.get("tie_word_embeddings"))
    return model


def load_gguf(path: Path, **kwargs) -> torch.nn.Module:
    return load_model(ModelConfig(model=str(path), dtype="float32", hf_config=model_hf_config(str(path)), **kwargs))


def assert_matches(model, hf_model, vocab: int) -> None:
    prompts = random_prompts(vocab, [5, 23, 1])
    for tokens, ours in zip(prompts, PagedBatch(model, len(prompts)).step(prompts, [(0, len(p)) for p in prompts])):
        assert_rel_close(ours, hf_logits(hf_model, tokens))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> tuple[Path, dict]:
    return tiny_hf(tmp_path_factory.mktemp("llama-hf"), "llama")


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_on_gguf_dequantization(case, tmp_path, caplog) -> None:
    arch, types, on_kernel = CASES[case]
    hf_dir, config = tiny_hf(tmp_path / "hf", arch)
    path = write_gguf(tmp_path / f"{case}.gguf", hf_dir, types)
    with caplog.at_level(logging.INFO, logger="kestrel.loader.gguf_weights"):
        model = load_gguf(path)
    methods = [m.quant_method for m in model.modules() if isinstance(getattr(m, "quant_method", None),
                                                                     GGUFLinearMethod)]
    assert set().union(*(m.ggml_types for m in methods)) == on_kernel
    if types.get("attn_v") == "F16":  # q, k, v merged into one GEMM: a float part dequantizes the whole layer
        assert not any(m.layer_name.endswith("qkv_proj") for m in methods)
    dequantized = {t for t in types.values() if t not in on_kernel and t not in ("F32", "F16", "BF16")}
    logged = [r.getMessage() for r in caplog.records if r.name == "kestrel.loader.gguf_weights"]
    assert len(logged) == (1 if dequantized or on_kernel else 0)
    for type_name in dequantized:
        assert type_name in logged[0] and "dequantized at load" in logged[0]
    assert_matches(model, oracle(hf_dir, [path], config), config["vocab_size"])


def test_llama3_rope_factors_match_transformers_llama3_scaling(tmp_path) -> None:
    """llama.cpp stores Llama 3.1's RoPE scaling as per-frequency divisors (rope_freqs); the oracle runs the
    original config's llama3 rope_scaling."""
    hf_dir, config = tiny_hf(tmp_path / "hf", "llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    path = write_gguf(tmp_path / "model.gguf", hf_dir, {"default": "Q8_0"})
    assert model_hf_config(str(path))["rope_parameters"]["rope_type"] == "longrope"
    assert_matches(load_gguf(path), oracle(hf_dir, [path], config), config["vocab_size"])


def _weight_of(part: gguf_blocks.Unpacked) -> torch.Tensor:
    values, scales, mins = part
    w = values.double().view(values.shape[0], scales.shape[1], -1) * scales.double()[..., None]
    if mins is not None:
        w = w - mins.double()[..., None]
    return w.reshape(values.shape)


def test_kernel_blocks_unpack_to_gguf_dequantization(tmp_path, llama_dir) -> None:
    """Every quantized type's blocks, unpacked in torch: `scales * values - mins` is gguf's dequantization exactly
    in the type's own form (the same float32 operations), and within one float32 rounding in every merged form that
    can hold it (groups split, offsets added, unsigned nibbles shifted into int4)."""
    hf_dir, _ = llama_dir
    for type_name, own in gguf_blocks.FORMS.items():
        path = write_gguf(tmp_path / f"{type_name}.gguf", hf_dir, {"default": type_name})
        tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
        oracle = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        blocks = blocks_of(tensor, "cpu")
        part = gguf_blocks.unpack(blocks, type_name)
        assert part.values.dtype == torch.int8 and (part.mins is not None) == own.mins
        torch.testing.assert_close(gguf_blocks.dequantize(blocks, type_name), oracle, rtol=0, atol=0)
        for bits in (own.bits, 8):
            for group in (own.group, 16):
                for mins in (own.mins, True):
                    form = gguf_blocks.BlockForm(bits, group, mins)
                    held = gguf_blocks.to_form(part, type_name, form)
                    assert held.scales.shape[1] * group == held.values.shape[1] and (held.mins is not None) == mins
                    if bits == 4:
                        assert int(held.values.min()) >= -8 and int(held.values.max()) <= 7
                    torch.testing.assert_close(_weight_of(held), oracle.double(), rtol=2.0**-22, atol=1e-7)


def test_split_files_load_from_the_directory_or_the_first_file(tmp_path, llama_dir) -> None:
    hf_dir, config = llama_dir
    out = tmp_path / "split"
    out.mkdir()
    write_gguf(out / "model.gguf", hf_dir, {"default": "Q8_0"}, split_max_tensors=8)
    files = sorted(out.glob("*.gguf"))
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    hf_model = oracle(hf_dir, files, config)
    for path in (out, files[0]):
        assert_matches(load_gguf(path), hf_model, config["vocab_size"])
    files[2].unlink()
    with pytest.raises(CheckpointError, match="model-00003-of-00003.gguf"):
        model_hf_config(str(out))


def test_llm_greedy_matches_transformers_and_reads_tokenizer_and_chat_template(tmp_path, llama_dir) -> None:
    hf_dir, config = llama_dir
    path = write_gguf(tmp_path / "model.gguf", hf_dir, {"default": "Q4_0"})
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_blocks=32, block_size=16)
    prompts = random_prompts(config["vocab_size"], [4, 11], seed=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    expected = hf_greedy(oracle(hf_dir, [path], config), prompts, 8)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert llm.tokenizer.chat_template == reference.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert (llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_a_tokenizer_directory_overrides_the_files_tokenizer(tmp_path, llama_dir) -> None:
    """`tokenizer=` (`--tokenizer`): the Hugging Face tokenizer of that directory, its own chat template, instead of
    the one the file's metadata builds."""
    hf_dir, config = llama_dir
    path = write_gguf(tmp_path / "model.gguf", hf_dir, {"default": "Q8_0"})
    override = tmp_path / "tokenizer"
    override.mkdir()
    shutil.copy(hf_dir / "tokenizer.json", override / "tokenizer.json")
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (override / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    from_file = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_blocks=16, block_size=16)
    overridden = LLM(str(path), tokenizer=str(override), dtype="float32", max_model_len=64, kv_cache_blocks=16,
                     block_size=16)
    messages = [{"role": "user", "content": "hi"}]
    assert overridden.tokenizer.apply_chat_template(messages, tokenize=False) == "<<hi>>"
    assert from_file.tokenizer.apply_chat_template(messages, tokenize=False) != "<<hi>>"
    prompt = random_prompts(config["vocab_size"], [6], seed=2)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert (overridden.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
            == from_file.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bpe_tokenizer_round_trips_and_special_tokens(tmp_path, arch) -> None:
    hf_dir, config = tiny_hf(tmp_path / "hf", arch)
    path = write_gguf(tmp_path / "model.gguf", hf_dir, {"default": "F32"})
    ours, reference = load_tokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert (ours.bos_token_id, ours.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    for text in ("The quick brown fox jumps over the lazy dog.", "café naïve 日本語 and code: x = [1, 2]\n\tdone",
                 "<|end_of_text|> special"):
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
        if arch == "llama":  # the file's pre-tokenizer ("gpt-2") is the tiny tokenizer's own
            assert ids == reference.encode(text, add_special_tokens=False)
        assert ours.encode(text)[0] == config["bos_token_id"]  # tokenizer.ggml.add_bos_token


def _tokenizer_parity(path: Path, texts: list[str]) -> None:
    """kestrel's tokenizer of a GGUF file against the one transformers builds from the file itself
    (`AutoTokenizer` with `gguf_file`, through its own GGUF reader), both then set from the metadata alike."""
    from kestrel.loader.gguf_files import find_gguf
    from kestrel.loader.gguf_tokenizer import adjusted_to_metadata

    ours = load_tokenizer(str(path))
    reference = adjusted_to_metadata(
        transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), find_gguf(path))
    assert type(ours) is type(reference) and ours.get_vocab() == reference.get_vocab()
    assert ours.all_special_tokens == reference.all_special_tokens and ours.chat_template == reference.chat_template
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special)
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_is_the_one_transformers_builds_from_the_file(tmp_path, arch) -> None:
    hf_dir, _ = tiny_hf(tmp_path / "hf", arch)
    path = write_gguf(tmp_path / "model.gguf", hf_dir, {"default": "F32"}, pre="llama-bpe")
    _tokenizer_parity(path, ["The quick brown fox, 20251 times.", "café 日本語\n\tx = [1, 2]", "<|end_of_text|> ok"])


def test_reader_matches_gguf_package(tmp_path, llama_dir) -> None:
    """kestrel's GGUF reader against `gguf.GGUFReader`: every metadata value, every tensor's name, type, shape,
    dtype and bytes (block types as bytes, F16 / F32 as numbers); a truncated file is a CheckpointError."""
    from kestrel.loader.gguf_files import find_gguf

    hf_dir, _ = llama_dir
    path = write_gguf(tmp_path / "model.gguf", hf_dir, {"default": "Q4_K", "attn_v": "Q6_K", "ffn_up": "F16"})
    ours, reference = find_gguf(path), gguf.GGUFReader(str(path))
    fields = {key: field.contents() for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert {key: ours.field(key) for key in fields} == fields
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.data.shape, mine.data.dtype) == (
            theirs.name, theirs.tensor_type, theirs.data.shape, theirs.data.dtype)
        assert np.array_equal(mine.data, theirs.data)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated.gguf.*past the end"):
        find_gguf(truncated).readers  # noqa: B018


def _gguf_bytes(fields: list[tuple[str, int, bytes]], version: int = 3) -> bytes:
    """A GGUF file without tensors: (key, value type, value bytes) entries."""
    out = b"GGUF" + struct.pack("<IQQ", version, 0, len(fields))
    for key, value_type, value in fields:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", value_type) + value
    return out


@pytest.mark.parametrize("case,match", [
    ([("general.alignment", 4, struct.pack("<I", 0))], "alignment must be a power of two, got 0"),
    ([("general.alignment", 4, struct.pack("<I", 24))], "alignment must be a power of two, got 24"),
    ([("general.alignment", 8, struct.pack("<Q", 1) + b"x")], "alignment must be a power of two, got 'x'"),
    ([("a", 4, struct.pack("<I", 1)), ("a", 4, struct.pack("<I", 2))], "key 'a' appears twice"),
    ([("name", 8, struct.pack("<Q", 1000) + b"short")], "past the end"),
    ([("ids", 9, struct.pack("<IQ", 5, 2**62))], "past the end"),
    ([("ids", 9, struct.pack("<IQ", 8, 2) + struct.pack("<Q", 2) + b"ok" + struct.pack("<Q", 99))], "past the end"),
])
def test_reader_refuses_malformed_metadata(tmp_path, case, match) -> None:
    from kestrel.loader.gguf_files import find_gguf

    path = tmp_path / "bad.gguf"
    path.write_bytes(_gguf_bytes(case))
    with pytest.raises(CheckpointError, match=f"bad.gguf.*{match}"):
        find_gguf(path).readers  # noqa: B018
    swapped = tmp_path / "swapped.gguf"
    swapped.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    with pytest.raises(CheckpointError, match="big-endian"):
        find_gguf(swapped).readers  # noqa: B018


def test_llama3_pre_tokenizer_splits_digits_in_threes(tmp_path, llama_dir) -> None:
    hf_dir, _ = llama_dir
    path = write_gguf(tmp_path / "model.gguf", hf_dir, {"default": "F32"}, pre="llama-bpe")
    tokenizer = load_tokenizer(str(path))
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("year 20251 ok")
    assert [p for p, _ in pieces] == ["year", "Ġ", "202", "51", "Ġok"]
    assert tokenizer.decode(tokenizer.encode("year 20251 ok", add_special_tokens=False)) == "year 20251 ok"


def test_sentencepiece_vocabulary_round_trips(tmp_path, llama_dir) -> None:
    """A "llama" (SentencePiece) vocabulary: pieces with scores, byte fallback, BOS added by default."""
    hf_dir, _ = llama_dir
    pieces = ["▁", "t", "h", "e", "a", "▁t", "he", "▁the", "▁a", "o", "g", "og"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             *[gguf.TokenType.BYTE] * 256, *[gguf.TokenType.NORMAL] * len(pieces)]
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    config = json.loads((hf_dir / "config.json").read_text())
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    # SentencePiece BPE merges the best-scored pair first: longer pieces score higher here.
    writer.add_token_scores([0.0] * 259 + [len(p) - i * 0.01 for i, p in enumerate(pieces)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", torch.zeros(len(tokens), 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = load_tokenizer(str(path))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<s>", "</s>", "<unk>")
    ids = tokenizer.encode("the dog ate 日")
    assert ids[0] == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the dog ate 日"
    assert tokens.index("▁the") in ids and tokens.index("<0xE6>") in ids  # a whole piece; UTF-8 bytes


def test_unsupported_type_architecture_and_layouts_are_config_errors(tmp_path, llama_dir) -> None:
    hf_dir, _ = llama_dir
    bad_type = write_gguf(tmp_path / "iq4.gguf", hf_dir, {"default": "Q8_0", "ffn_up": "IQ4_NL"})
    with pytest.raises(ConfigError, match=r"IQ4_NL \(e\.g\. blk\.0\.ffn_up\.weight\).*Q4_K"):
        model_hf_config(str(bad_type))
    other = tmp_path / "other"
    other.mkdir()
    bad_arch = write_gguf(other / "phi.gguf", hf_dir, {"default": "F32"}, architecture="phi2")
    with pytest.raises(ConfigError, match=r"'phi2'.*\['llama', 'qwen2', 'qwen3'\]"):
        model_hf_config(str(bad_arch))
    shutil.copy(bad_type, other / "second.gguf")
    with pytest.raises(ConfigError, match="holds 2 GGUF models"):
        model_hf_config(str(other))
    with pytest.raises(ConfigError, match="metadata"):
        ModelConfig(model=str(bad_arch))
    good = write_gguf(tmp_path / "good.gguf", hf_dir, {"default": "Q8_0"})
    with pytest.raises(ConfigError, match="load_format='safetensors'"):
        load_gguf(good, load_format="safetensors")
    with pytest.raises(ConfigError, match="quantization_config.quant_method='gguf'"):
        LLM(str(good), dtype="float32", quantization="fp8")
