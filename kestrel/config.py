"""Engine configuration: frozen dataclasses, validated once at construction.

Only the standard library is imported here, so the engine (pure Python) and the
CLI can both build and check a configuration without loading torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_SIZE_CHOICES = (16,)
DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
# vLLM's other names of the same types (its --dtype and --kv-cache-dtype take them too).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}  # kestrel's FP8 KV cache is E4M3
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "pt", "dummy")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8")
# The one list of quantization names: quantize at load ("fp8", "int8") or load a checkpoint saved in a format.
QUANTIZATION_CHOICES = (None, "fp8", "int8", "compressed-tensors", "gptq", "awq", "bitsandbytes")
# Names of checkpoint formats only: a checkpoint saved in them loads as saved; nothing is quantized to them at load.
CHECKPOINT_ONLY_QUANTIZATION = ("compressed-tensors", "gptq", "awq", "bitsandbytes")
ACTIVATION_SCHEME_CHOICES = ("dynamic", "static")
FP8_BLOCK_ACTIVATION_CHOICES = ("model_dtype", "fp8")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
# When the CUDA graphs are captured (EngineConfig.graph_capture): before the engine serves, or once it serves.
GRAPH_CAPTURE_CHOICES = ("serving", "startup")
MEDIA_MODALITIES = ("image", "audio", "video")
DEFAULT_MM_PER_PROMPT = 999  # vLLM's default per modality: the context length is the real bound
# Steps between the expert-load counts' reports (each one a host copy and a conversion of [layers, experts] ints).
EXPERT_LOAD_INTERVAL = 32
# max_prefill_graph_tokens: 0 or a power of two in this range (the token buckets double from its low end).
PREFILL_GRAPH_TOKEN_RANGE = (16, 8192)
# max_prefill_graph_tokens left unset (None) means this limit wherever the runner captures CUDA graphs at all (one
# CUDA device, not enforce_eager, no M-RoPE, not encoder-decoder), else off: FP8 1000 x 1000/1000 at max_num_seqs
# 512 on the H200 ran 16,391 output tok/s with it against 15,912 eager, capture +1.0 s (docs/benchmarks.md).
DEFAULT_PREFILL_GRAPH_TOKENS = 512
SCHEDULING_POLICY_CHOICES = ("fcfs", "priority", "shortest_prefill")
DEFAULT_STARVATION_BOUND = 64
# None: the model runs in the engine's process on one device, in "mp" worker processes on several.
DISTRIBUTED_EXECUTOR_BACKEND_CHOICES = (None, "mp", "ray")
# vLLM's runners: "generate" (text), "pooling" (embeddings, classification, scores); "auto" picks by architecture.
RUNNER_CHOICES = ("auto", "generate", "pooling")
# A checkpoint whose architecture ends so is a decoder with a classification head (`score`), served by the pooler.
SEQUENCE_CLASSIFICATION_SUFFIX = "ForSequenceClassification"
POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLER_CONFIG_KEYS = ("pooling_type", "normalize")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


class CheckpointError(ConfigError):
    """A weight file (or its index) is truncated or corrupt; the message names the file and what is wrong."""


# Sane bounds of config.json's shape fields: (least, most). Every released model lies well inside them (the
# largest: vocab 262,144, hidden 16,384 / 53,248 intermediate / 126 layers / 128 heads, head_dim 256, 10M
# positions); a value outside is a corrupt or hostile config, refused before anything is sized from it.
HF_CONFIG_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1 << 12),
    "num_key_value_heads": (1, 1 << 12),
    "head_dim": (1, 1 << 12),
    "max_position_embeddings": (1, 1 << 24),
}
# Fields that may be null or absent, with a derived value (head_dim from hidden_size, the KV heads from the
# query heads, a default context).
_HF_OPTIONAL = frozenset({"num_key_value_heads", "head_dim", "max_position_embeddings"})


def text_decoder_config(hf: dict) -> dict:
    """A multimodal checkpoint's config.json keeps its language model's fields under `text_config`: those fields,
    with the top level's for what the text config leaves out (architectures, dtype, quantization), and the
    encoders' configs (`vision_config`, `audio_config`) as they are, for the multimodal families. Other configs
    as they are."""
    if hf.get("model_type") == "whisper":
        return whisper_decoder_config(hf)
    text = hf.get("text_config")
    if not isinstance(text, dict) or "num_hidden_layers" in hf:
        return hf
    outer = {key: value for key, value in hf.items() if key != "text_config"}
    return {**outer, **text, "architectures": hf.get("architectures")}


def validate_hf_config(hf: Any, source: str) -> None:
    """Refuse a config.json (`source` names it in the message) whose shape fields are not integers within
    `HF_CONFIG_BOUNDS`, or whose heads do not divide: checked before anything is sized from them. An absent
    required field is left to the family, whose error names what it needs."""
    if not isinstance(hf, dict):
        raise ConfigError(f"invalid {source}: expected a JSON object, got {type(hf).__name__}")
    for name, (least, most) in HF_CONFIG_BOUNDS.items():
        if name not in hf or (hf[name] is None and name in _HF_OPTIONAL):
            continue
        value = hf[name]
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise ConfigError(f"invalid {source}: {name}={value!r}: expected an integer in [{least}, {most}] "
                              "(kestrel's sanity bound; every real model lies within it)")
    heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ConfigError(f"invalid {source}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv_heads}; each KV head serves a whole group of query heads")
    hidden = hf.get("hidden_size")
    if hf.get("head_dim") is None and heads is not None and hidden is not None and hidden % heads:
        raise ConfigError(f"invalid {source}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                          "and no head_dim is given; give head_dim or a hidden_size that is a multiple of the heads")


def whisper_decoder_config(hf: dict) -> dict:
    """An encoder-decoder Whisper config.json with its decoder's shape under the decoder-only names the engine
    sizes from (hidden_size, layers, heads, context = max_target_positions); its own fields stay as they are."""
    names = {"hidden_size": "d_model", "num_hidden_layers": "decoder_layers",
             "num_attention_heads": "decoder_attention_heads", "intermediate_size": "decoder_ffn_dim",
             "max_position_embeddings": "max_target_positions"}
    return {**hf, **{ours: hf[theirs] for ours, theirs in names.items() if theirs in hf}}


DEFAULT_HF_HUB_CACHE = os.path.join("~", ".cache", "huggingface", "hub")


def resolve_model_path(model: str, download_dir: str | None = None) -> str:
    """A model directory as given, or a Hugging Face model id ("org/name") found in a local hub cache
    (`download_dir`, default ~/.cache/huggingface/hub): the snapshot that refs/main names, else the newest one.
    Nothing is downloaded."""
    if os.path.exists(model) or model.count("/") != 1 or model.startswith(("/", ".", "~")):
        return model
    cache = os.path.expanduser(download_dir or DEFAULT_HF_HUB_CACHE)
    repo = os.path.join(cache, "models--" + model.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    ref = os.path.join(repo, "refs", "main")
    if os.path.isfile(ref):
        with open(ref) as f:
            candidate = os.path.join(snapshots, f.read().strip())
        if os.path.isdir(candidate):
            return candidate
    if os.path.isdir(snapshots):
        found = [os.path.join(snapshots, d) for d in os.listdir(snapshots)]
        found = [d for d in found if os.path.isdir(d)]
        if found:
            return max(found, key=os.path.getmtime)
    _fail("model", model, f"no such directory, and no snapshot of the Hugging Face model {model!r} in the local "
          f"cache {cache} (kestrel does not download: fetch it with `huggingface-cli download {model}` or pass a "
          "directory; download_dir / HF_HUB_CACHE name another cache)")
    return model


GGUF_SUFFIX = ".gguf"


def is_gguf_model(model: str) -> bool:
    """True for a llama.cpp GGUF model: a .gguf file, or a directory without config.json holding .gguf files
    (one model, possibly split; `kestrel.loader.gguf_files` finds them)."""
    if os.path.isfile(model):
        return model.endswith(GGUF_SUFFIX)
    return (os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json"))
            and any(name.endswith(GGUF_SUFFIX) for name in os.listdir(model)))


def _fail(field_name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"invalid {field_name}={value!r}: {allowed}")


def _check_choice(field_name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(field_name, value, f"expected one of {list(choices)}")


def _check_config_dict(field_name: str, value: Any, example: str, known: list[str]) -> None:
    """A JSON-valued setting: a dict whose keys are among `known`."""
    if not isinstance(value, dict):
        _fail(field_name, value, f"expected a dict such as {example}")
    unknown = sorted(set(value) - set(known))
    if unknown:
        _fail(field_name, value, f"unknown keys {unknown}; known: {known}")


def _check_int(field_name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(field_name, value, f"expected an integer >= {minimum}" + (" or None" if allow_none else ""))


def _check_positive_number(field_name: str, value: Any, expected: str, below: float = math.inf,
                           allow_none: bool = False) -> None:
    """A number > 0 and < `below` (NaN, infinities and booleans refused), else `expected` says what is."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < below:
        _fail(field_name, value, expected)


# generation_config.json keys -> SamplingParams fields (the ones a model's defaults may set): the same names, and
# max_new_tokens as max_tokens (which the server also takes as a cap, as vLLM does).
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_GENERATION_RENAMED_KEYS = {"max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """A model's generation_config.json as the engine applies it: its EOS ids end generation besides the
    tokenizer's, and its sampling settings are the defaults of requests that leave them unset (vLLM's
    `--generation-config auto`)."""

    eos_token_ids: frozenset[int] = frozenset()
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value


def _read_generation_defaults(path: str | None, setting: str) -> GenerationDefaults:
    if path is None:
        return GenerationDefaults()
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"invalid generation_config={setting!r}: {path} could not be read ({e}); fix it or pass "
                          "generation_config='vllm' to ignore it") from None
    eos = data.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(t, int) and t >= 0 for t in eos_ids):
        raise ConfigError(f"invalid generation_config: eos_token_id={eos!r} in {path} is not a token id or a list "
                          "of them")
    sampling = {key: data[key] for key in GENERATION_SAMPLING_KEYS if data.get(key) is not None}
    for key, name in _GENERATION_RENAMED_KEYS.items():
        if data.get(key) is not None:
            if isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < 1:
                raise ConfigError(f"invalid generation_config: {key}={data[key]!r} in {path} is not a token count "
                                  ">= 1; fix it or pass generation_config='vllm' to ignore the file")
            sampling[name] = data[key]
    return GenerationDefaults(frozenset(eos_ids), sampling)


# sentence-transformers' Pooling config keys -> our pooling types (the ones a decoder can pool with).
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}
_SENTENCE_TRANSFORMERS_MODULE = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolerSettings:
    """What the pooling runner does with a prompt's final hidden states: `task` "embed" (the pooled vector,
    L2-normalized when `normalize`) or "classify" (the classification head's `num_labels` logits of it);
    `source` says where the settings came from, for errors and the log."""

    task: str
    pooling_type: str
    normalize: bool
    num_labels: int = 0
    source: str = "default"


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"invalid {what} {path!r}: {e}; fix the file or override it with --pooler-config") from e


def sentence_transformers_pooling(model_dir: str, type_overridden: bool = False) -> tuple[str, bool] | None:
    """(pooling type, normalize) as a sentence-transformers checkpoint declares them (`modules.json`, its Pooling
    module's `config.json`, a `Normalize` module), or None without a modules.json. `type_overridden`: the pooling
    type comes from --pooler-config, so a pooling mode kestrel lacks is no error."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _read_json(modules_path, "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"invalid modules.json {modules_path!r}: expected a list of module objects")
    pooling_type, normalize = "LAST", False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_SENTENCE_TRANSFORMERS_MODULE)
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            config = _read_json(os.path.join(model_dir, str(module.get("path", "")), "config.json"),
                                "sentence-transformers Pooling config")
            modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
            if type_overridden:
                continue
            if len(modes) != 1 or modes[0] not in _SENTENCE_TRANSFORMERS_MODES:
                raise ConfigError(f"unsupported sentence-transformers pooling {modes} in {module.get('path')!r}/"
                                  f"config.json: kestrel pools with one of {sorted(_SENTENCE_TRANSFORMERS_MODES)}; "
                                  "override it with --pooler-config '{\"pooling_type\": \"LAST\"}' (or MEAN, CLS)")
            pooling_type = _SENTENCE_TRANSFORMERS_MODES[modes[0]]
        else:
            raise ConfigError(f"unsupported sentence-transformers module {module.get('type')!r} in modules.json: "
                              "kestrel runs the transformer, its pooling and normalization only (no Dense or other "
                              "layers after the pooling)")
    return pooling_type, normalize


def num_labels(hf: dict) -> int:
    """A classification checkpoint's label count, as transformers reads it (`id2label`, else 2)."""
    labels = hf.get("id2label")
    count = len(labels) if isinstance(labels, dict) and labels else hf.get("num_labels", 2)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        _fail("num_labels", count, "config.json's id2label / num_labels must name at least one label")
    return count


def resolve_pooler(model_dir: str, hf: dict, architecture: str, overrides: dict | None) -> PoolerSettings:
    """The pooling runner's settings: a classification checkpoint pools its last token into its head; an
    embedding model pools as its sentence-transformers files say, else last token + normalization (decoder
    embedding models such as Qwen3-Embedding); `overrides` (--pooler-config) replace either."""
    if architecture.endswith(SEQUENCE_CLASSIFICATION_SUFFIX):
        settings = PoolerSettings("classify", "LAST", False, num_labels(hf), "classification head")
    else:
        declared = sentence_transformers_pooling(model_dir, isinstance(overrides, dict) and "pooling_type" in overrides)
        settings = (PoolerSettings("embed", "LAST", True) if declared is None
                    else PoolerSettings("embed", declared[0], declared[1], source="modules.json"))
    if not overrides:
        return settings
    if not isinstance(overrides, dict):
        _fail("pooler_config", overrides, f"expected a JSON object with keys among {list(POOLER_CONFIG_KEYS)}")
    for key, value in overrides.items():
        if key not in POOLER_CONFIG_KEYS:
            _fail(f"pooler_config.{key}", value, f"not a setting kestrel's pooler has; use {list(POOLER_CONFIG_KEYS)}")
    pooling_type = overrides.get("pooling_type", settings.pooling_type)
    _check_choice("pooler_config.pooling_type", pooling_type, POOLING_TYPES)
    normalize = overrides.get("normalize", settings.normalize)
    if not isinstance(normalize, bool):
        _fail("pooler_config.normalize", normalize, "expected true or false")
    if normalize and settings.task == "classify":
        _fail("pooler_config.normalize", normalize, f"{architecture} classifies: its head's logits are not "
              "normalized; leave normalize out")
    return dataclasses.replace(settings, pooling_type=pooling_type, normalize=normalize, source="pooler_config")


@dataclass(frozen=True)
class ModelConfig:
    """What to load. `hf_config` is the parsed config.json of the checkpoint."""

    model: str
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    tokenizer: str | None = None
    generation_config: str = "auto"  # "auto" (the model's generation_config.json), "vllm" (none) or a directory
    download_dir: str | None = None  # the Hugging Face hub cache a model id is looked up in
    trust_remote_code: bool = False  # let the tokenizer run the Python code its directory ships
    hf_overrides: dict | None = None  # config.json keys replaced after reading it (vLLM's hf_overrides)
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for; -1: the whole vocabulary
    runner: str = "auto"  # resolved to "generate" or "pooling" ("pooling" for a classification architecture)
    pooler_config: dict | None = None  # the pooling runner's overrides: {"pooling_type": ..., "normalize": ...}
    # Multimodal models (docs/multimodal.md): most items per prompt by modality ({"image": 2}; default
    # DEFAULT_MM_PER_PROMPT each), the image processor's settings, and where images may come from besides data: URLs.
    limit_mm_per_prompt: dict | None = None
    mm_processor_kwargs: dict | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults, compare=False, repr=False)
    pooler: PoolerSettings | None = field(default=None, init=False, compare=False, repr=False)  # with "pooling"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        _check_choice("dtype", self.dtype, DTYPE_CHOICES)
        _check_choice("load_format", self.load_format, LOAD_FORMAT_CHOICES)
        _check_int("seed", self.seed, 0)
        if self.max_model_len == -1:
            _fail("max_model_len", -1, "vLLM's -1 (fit the context to memory) is not taken here: leave max_model_len "
                  "out for the model's own context, or give a number of tokens")
        _check_int("max_model_len", self.max_model_len, 1, allow_none=True)
        _check_int("max_logprobs", self.max_logprobs, -1)
        if not isinstance(self.model, str) or not self.model:
            _fail("model", self.model, "expected the path of a Hugging Face model directory")
        object.__setattr__(self, "model", resolve_model_path(self.model, self.download_dir))
        config_path = os.path.join(self.model, "config.json")
        gguf = is_gguf_model(self.model)
        if gguf and not self.hf_config:
            _fail("model", self.model, "a GGUF model's config is read from its metadata (kestrel.loader.gguf_config; "
                  "LLM(...) and `kestrel serve` do it): pass it as hf_config")
        if not gguf and not os.path.isdir(self.model):
            _fail("model", self.model, "no such directory; pass the path of a Hugging Face model directory "
                  "(create a small one with `kestrel model-init --arch llama --size tiny DIR`)")
        elif not gguf and not os.path.isfile(config_path):
            _fail("model", self.model, "the directory has no config.json; it must be a Hugging Face model directory "
                  "(or hold a GGUF model)")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(str(self.generation_config), "generation_config.json")):
            _fail("generation_config", self.generation_config, "expected 'auto' (the model's generation_config.json), "
                  "'vllm' (none) or a directory that holds a generation_config.json")
        if not self.hf_config:
            try:
                with open(config_path) as f:
                    object.__setattr__(self, "hf_config", json.load(f))
            except json.JSONDecodeError as e:
                _fail("model", self.model, f"config.json is not valid JSON ({e})")
        if not isinstance(self.hf_config, dict):
            _fail("model", self.model, f"config.json holds a JSON {type(self.hf_config).__name__}, not an object")
        object.__setattr__(self, "hf_config", text_decoder_config(self.hf_config))
        if self.hf_overrides is not None:
            if not isinstance(self.hf_overrides, dict):
                _fail("hf_overrides", self.hf_overrides, "expected a dict of config.json keys and values")
            object.__setattr__(self, "hf_config", {**self.hf_config, **self.hf_overrides})
        self._check_media_fields()
        validate_hf_config(self.hf_config, f"config.json of model={self.model!r}"
                           + (" with hf_overrides" if self.hf_overrides else ""))
        object.__setattr__(self, "generation_defaults",
                           _read_generation_defaults(self.generation_config_path, self.generation_config))
        context = self.hf_config.get("max_position_embeddings")
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", int(context) if context else 2048)
        elif context and self.max_model_len > int(context):
            _fail("max_model_len", self.max_model_len,
                  f"the model's context is max_position_embeddings={context}; use a value <= {context}")
        self._resolve_runner()

    def _resolve_runner(self) -> None:
        _check_choice("runner", self.runner, RUNNER_CHOICES)
        classifier = self.architecture.endswith(SEQUENCE_CLASSIFICATION_SUFFIX)
        if self.runner == "auto":
            object.__setattr__(self, "runner", "pooling" if classifier else "generate")
        elif self.runner == "generate" and classifier:
            _fail("runner", self.runner, f"{self.architecture} has a classification head and no language-model "
                  "head, so it cannot generate; use runner='pooling' (--runner pooling)")
        if self.runner != "pooling":
            if self.pooler_config is not None:
                _fail("pooler_config", self.pooler_config, "it configures the pooling runner; add "
                      "runner='pooling' (--runner pooling) or leave it out")
            return
        object.__setattr__(self, "pooler", resolve_pooler(self.model, self.hf_config, self.architecture,
                                                          self.pooler_config))

    def _check_media_fields(self) -> None:
        limits = self.limit_mm_per_prompt
        if limits is not None:
            if not isinstance(limits, dict):
                _fail("limit_mm_per_prompt", limits, 'expected a JSON object of modality -> count, e.g. {"image": 2}')
            for modality, count in limits.items():
                if modality not in MEDIA_MODALITIES:
                    _fail(f"limit_mm_per_prompt.{modality}", count, f"unknown modality; kestrel knows "
                          f"{', '.join(MEDIA_MODALITIES)}")
                _check_int(f"limit_mm_per_prompt.{modality}", count, 0)
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            _fail("mm_processor_kwargs", self.mm_processor_kwargs, "expected a JSON object of the image processor's "
                  "settings")
        path = self.allowed_local_media_path
        if path is not None and (not isinstance(path, str) or not os.path.isdir(path)):
            _fail("allowed_local_media_path", path, "expected an existing directory: file:// images are read "
                  "only from under it")
        domains = self.allowed_media_domains
        if domains is not None:
            if isinstance(domains, str):
                domains = (domains,)
            if not isinstance(domains, (tuple, list)) or not all(isinstance(d, str) and d for d in domains):
                _fail("allowed_media_domains", domains, "expected one or more domain names")
            object.__setattr__(self, "allowed_media_domains", tuple(d.lower() for d in domains))

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or []
        return archs[0] if archs else ""

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def generation_config_path(self) -> str | None:
        """The generation_config.json that applies, if any."""
        if self.generation_config == "vllm":
            return None
        directory = self.model if self.generation_config == "auto" else self.generation_config
        path = os.path.join(directory, "generation_config.json")
        return path if os.path.isfile(path) else None


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. `kv_cache_blocks` (vLLM's num_gpu_blocks_override) overrides the count derived from
    memory."""

    block_size: int = 16
    kv_cache_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    kv_cache_memory_bytes: int | None = None  # absolute KV budget on any device; overrides the fraction
    # Multimodal models: the encoder cache's bound in embedding rows (an image's placeholder count each).
    encoder_cache_size: int = 16384
    # An FP8 cache's k_scale / v_scale per layer measured at start-up (amax / 448 of a calibration prefill of random
    # token ids, before the graphs are captured) in place of the checkpoint's, or of 1.0 where it has none.
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        _check_choice("block_size", self.block_size, BLOCK_SIZE_CHOICES)
        _check_int("kv_cache_blocks", self.kv_cache_blocks, 1, allow_none=True)
        object.__setattr__(self, "kv_cache_dtype", KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype))
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES)
        if not isinstance(self.enable_prefix_caching, bool):
            _fail("enable_prefix_caching", self.enable_prefix_caching, "expected True or False")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            _fail("gpu_memory_utilization", self.gpu_memory_utilization, "expected a fraction in (0, 1]")
        _check_int("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes, 1)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, allow_none=True)
        _check_int("encoder_cache_size", self.encoder_cache_size, 1)
        if not isinstance(self.calculate_kv_scales, bool):
            _fail("calculate_kv_scales", self.calculate_kv_scales, "expected True or False")
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            _fail("calculate_kv_scales", self.calculate_kv_scales, "it measures an FP8 KV cache's scales; set "
                  "kv_cache_dtype='fp8' (--kv-cache-dtype fp8) with it, or leave it False")

    @property
    def num_blocks(self) -> int | None:
        """The earlier name of kv_cache_blocks, read by the worker's cache sizing."""
        return self.kv_cache_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step shared by decodes and prefill chunks."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    # Schedule and launch step N+1 while step N runs on the device; its sampled ids feed N+1 on the device and
    # reach the host one step later (stop checks lag a step; batches needing the host's view of the latest
    # token, such as penalties, run synchronously). None: on for a GPU runner, off on the CPU (nothing to
    # overlap there).
    async_scheduling: bool | None = None
    # "fcfs": first come, first served; "priority": lowest `priority` value first (then arrival), and the
    # lowest-priority running request is the one preempted (vLLM's --scheduling-policy); "shortest_prefill":
    # within a priority, the shortest prompt first, bounded by `starvation_bound`.
    policy: str = "fcfs"
    # shortest_prefill only: once this many requests were admitted since a request arrived, it goes before every
    # later arrival of its priority. None: 64 under shortest_prefill.
    starvation_bound: int | None = None
    # Aim each step that carries decoding requests at this many milliseconds (their time between tokens): decodes
    # are scheduled first, and prefill chunks get what the measured step cost (engine/step_cost.py) leaves of the
    # target, at least scheduler.MIN_PREFILL_CHUNK tokens. None: every step takes up to max_num_batched_tokens.
    step_time_target_ms: float | None = None

    def __post_init__(self) -> None:
        _check_choice("scheduling_policy", self.policy, SCHEDULING_POLICY_CHOICES)
        _check_positive_number("step_time_target_ms", self.step_time_target_ms,
                               "expected a number of milliseconds > 0, or None (off)", allow_none=True)
        if self.policy == "shortest_prefill":
            if self.starvation_bound is None:
                object.__setattr__(self, "starvation_bound", DEFAULT_STARVATION_BOUND)
            _check_int("scheduling_starvation_bound", self.starvation_bound, 1)
        elif self.starvation_bound is not None:
            _fail("scheduling_starvation_bound", self.starvation_bound, "it bounds the shortest_prefill policy's "
                  f"reordering, and the policy is {self.policy!r}; use --scheduling-policy shortest_prefill or "
                  "leave it unset")
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            _fail("async_scheduling", self.async_scheduling, "expected True, False or None (automatic)")


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size x pipeline_parallel_size worker processes (one per device). With one device and no
    backend named, the model runs in the engine's own process; naming a backend runs even one device through
    a worker process."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # How long the engine waits for a worker (process-group setup, a step's reply) before failing; a worker
    # that dies is noticed at once.
    distributed_timeout_s: float = 300.0
    # Mixture-of-experts layers: each tensor-parallel rank owns whole experts instead of a slice of every one.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            _check_int(name, getattr(self, name), 1)
        if not isinstance(self.enable_expert_parallel, bool):
            _fail("enable_expert_parallel", self.enable_expert_parallel, "expected True or False")
        _check_choice("distributed_executor_backend", self.distributed_executor_backend,
                      DISTRIBUTED_EXECUTOR_BACKEND_CHOICES)
        _check_positive_number("distributed_timeout_s", self.distributed_timeout_s,
                               "expected a finite number of seconds > 0 (below 1e9)", below=1e9)
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            _fail("distributed_executor_backend", "ray", "the ray package is not installed here; install it "
                  "(pip install ray) or use 'mp' (worker processes on this machine)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def uses_workers(self) -> bool:
        """True when the model runs in worker processes behind an executor."""
        return self.world_size > 1 or self.distributed_executor_backend is not None


@dataclass(frozen=True)
class QuantConfig:
    """W8A8 quantization. `method=None` runs the checkpoint's own dtype."""

    method: str | None = None
    activation_scheme: str = "dynamic"
    symmetric_activations: bool = True
    # The dense layers of a block-FP8 checkpoint: activations in the model dtype on the weight-only kernel, or
    # "fp8": quantized per token and block as the checkpoint says, on the W8A8 block GEMM.
    fp8_block_activations: str = "model_dtype"

    def __post_init__(self) -> None:
        _check_choice("quantization", self.method, QUANTIZATION_CHOICES)
        _check_choice("activation_scheme", self.activation_scheme, ACTIVATION_SCHEME_CHOICES)
        _check_choice("fp8_block_activations", self.fp8_block_activations, FP8_BLOCK_ACTIVATION_CHOICES)
        if self.method == "fp8" and not self.symmetric_activations:
            _fail("symmetric_activations", self.symmetric_activations,
                  "asymmetric activations exist only for quantization='int8'")
        if self.method is None and self.activation_scheme == "static":
            _fail("activation_scheme", self.activation_scheme, "static activation scales need a quantization method")


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle")
# The config.json architecture of an EAGLE-style head (kestrel.model.eagle): it names the method when none is given.
EAGLE_HEAD_ARCHITECTURE = "KestrelEagleHead"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with vLLM's names. Proposers:
    - "ngram" (prompt lookup): the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked
      up earlier in the prompt and output, and the tokens that followed the latest match are proposed;
    - "draft_model": `model` is a smaller checkpoint with the target's vocabulary, run greedily k steps;
    - "eagle": `model` is an EAGLE-style head (one decoder layer over the target's last hidden state and the next
      token's embedding, sharing the target's embedding and LM head), run greedily k steps.
    The target verifies num_speculative_tokens of them in one forward. As in vLLM, `method` may be left out when
    `model` is given: a head (its config.json architecture, or "eagle" in its directory name) means "eagle",
    anything else "draft_model"; without `model` it means "ngram".
    Speculation is off for a step whose running batch exceeds disable_by_batch_size (it pays at small batch)."""

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    draft_hf_config: dict = field(default_factory=dict, compare=False, repr=False, init=False)

    def __post_init__(self) -> None:
        if self.model is not None:
            self._read_model()
        if self.method is None:
            object.__setattr__(self, "method", self._inferred_method())
        if self.method not in SPECULATIVE_METHODS:
            _fail("speculative_config.method", self.method, f"expected one of {list(SPECULATIVE_METHODS)}")
        if self.method == "ngram" and self.model is not None:
            _fail("speculative_config.model", self.model, "method 'ngram' proposes from the prompt and takes no "
                  "model; drop model or use method 'draft_model' / 'eagle'")
        if self.method != "ngram" and self.model is None:
            _fail("speculative_config.model", None, f"method {self.method!r} needs the path of its checkpoint")
        _check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        _check_int("speculative_config.disable_by_batch_size", self.disable_by_batch_size, 1, allow_none=True)
        is_head = self._names_a_head
        if self.method == "draft_model" and is_head:
            _fail("speculative_config.model", self.model, "this is an EAGLE-style head, not a draft model; use "
                  "method 'eagle'")
        if self.method == "eagle" and self.model is not None and not is_head:
            _fail("speculative_config.model", self.model, f"method 'eagle' needs an EAGLE-style head (config.json "
                  f"architectures [{EAGLE_HEAD_ARCHITECTURE!r}], as scripts/train_eagle_tiny.py writes)")

    def _read_model(self) -> None:
        if not isinstance(self.model, str) or not os.path.isfile(os.path.join(self.model, "config.json")):
            _fail("speculative_config.model", self.model, "expected a model directory holding a config.json")
        try:
            with open(os.path.join(self.model, "config.json")) as f:
                object.__setattr__(self, "draft_hf_config", json.load(f))
        except json.JSONDecodeError as e:
            _fail("speculative_config.model", self.model, f"config.json is not valid JSON ({e})")
        validate_hf_config(self.draft_hf_config, f"config.json of speculative_config.model={self.model!r}")

    @property
    def _names_a_head(self) -> bool:
        """`model`'s config.json declares an EAGLE-style head."""
        return EAGLE_HEAD_ARCHITECTURE in (self.draft_hf_config.get("architectures") or [])

    def _inferred_method(self) -> str:
        if self.model is None:
            return "ngram"
        named = "eagle" in os.path.basename(os.path.normpath(self.model)).lower()
        return "eagle" if self._names_a_head or named else "draft_model"

    @property
    def uses_model(self) -> bool:
        """Drafts come from a model the worker runs (not from the engine's n-gram lookup)."""
        return self.method in ("draft_model", "eagle")

    def check_target(self, target: dict, max_model_len: int, kv_cache_dtype: str) -> None:
        """The draft checkpoint must fit the target: the same vocabulary, positions up to max_model_len, a
        16-bit KV cache (its K/V share the target's blocks), and for a head the target's hidden size."""
        if not self.uses_model:
            return
        draft = self.draft_hf_config
        if draft.get("vocab_size") != target.get("vocab_size"):
            _fail("speculative_config.model", self.model, f"its vocab_size={draft.get('vocab_size')} differs from "
                  f"the target's {target.get('vocab_size')}; a draft must share the target's tokenizer")
        context = draft.get("max_position_embeddings")
        if context and int(context) < max_model_len:
            _fail("speculative_config.model", self.model, f"its max_position_embeddings={context} is below "
                  f"max_model_len={max_model_len}; lower max_model_len")
        if self.method == "eagle" and draft.get("hidden_size") != target.get("hidden_size"):
            _fail("speculative_config.model", self.model, f"the head's hidden_size={draft.get('hidden_size')} "
                  f"differs from the target's {target.get('hidden_size')}; train the head on this target")
        if kv_cache_dtype != "auto":
            _fail("kv_cache_dtype", kv_cache_dtype, f"speculative method {self.method!r} keeps the draft's K/V "
                  "in the target's blocks at the model's dtype; use kv_cache_dtype='auto'")

    @classmethod
    def from_dict(cls, value: dict) -> SpeculativeConfig:
        _check_config_dict("speculative_config", value, "{'method': 'ngram', 'num_speculative_tokens': 4}",
                           sorted(f.name for f in dataclasses.fields(cls) if f.init))
        config = cls(**value)
        lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(value))
        if lookup and config.method != "ngram":
            _fail(f"speculative_config.{lookup[0]}", value[lookup[0]], f"it tunes method 'ngram' only, and the method "
                  f"is {config.method!r}; drop it")
        return config


# The name `prompt_compressor` takes for the bundled kestrel-tiny model (kestrel/models/kestrel-tiny).
BUNDLED_COMPRESSOR_NAME = "kestrel-tiny"
_BUNDLED_COMPRESSOR_DIR = Path(__file__).resolve().parent / "models" / BUNDLED_COMPRESSOR_NAME


@dataclass(frozen=True)
class PromptCompressorConfig:
    """The small causal LM that scores prompt tokens for prompt compression (`prompt_compressor`): a Hugging Face
    model directory kestrel can load, or "kestrel-tiny" for the bundled model. It runs in the serving process on
    the engine's device, with its own small KV cache; its tokenizer may differ from the served model's.
    `window`: the most tokens scored in one forward (its context, at most 2048); `batch`: windows per forward."""

    model: str
    window: int = 0  # 0: min(the compressor's context, 2048)
    batch: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            _fail("prompt_compressor", self.model, f"expected a model directory or {BUNDLED_COMPRESSOR_NAME!r}")
        if self.model == BUNDLED_COMPRESSOR_NAME:
            object.__setattr__(self, "model", str(_BUNDLED_COMPRESSOR_DIR))
        config_file = os.path.join(self.model, "config.json")
        if not os.path.isfile(config_file):
            _fail("prompt_compressor", self.model, f"expected a model directory holding a config.json (or "
                  f"{BUNDLED_COMPRESSOR_NAME!r} for the bundled model)")
        try:
            with open(config_file) as f:
                hf = json.load(f)
        except json.JSONDecodeError as e:
            _fail("prompt_compressor", self.model, f"config.json is not valid JSON ({e})")
        validate_hf_config(hf, f"config.json of prompt_compressor={self.model!r}")
        architectures = hf.get("architectures") or []
        if not any(str(name).endswith("ForCausalLM") for name in architectures):
            _fail("prompt_compressor", self.model, f"the compressor must be a causal LM (a *ForCausalLM "
                  f"architecture); config.json says {architectures}")
        if not any(os.path.isfile(os.path.join(self.model, name)) for name in ("tokenizer.json",
                                                                             "tokenizer_config.json")):
            _fail("prompt_compressor", self.model, "the directory has no tokenizer (tokenizer.json); the compressor "
                  "scores text with its own tokenizer")
        context = int(hf.get("max_position_embeddings") or 2048)
        if self.window == 0:
            object.__setattr__(self, "window", min(context, 2048))
        _check_int("prompt_compressor window", self.window, 32)
        if self.window > context:
            _fail("prompt_compressor window", self.window, f"the compressor's context is {context} tokens")
        _check_int("prompt_compressor batch", self.batch, 1)


SPARSE_DECODE_METHODS = ("quest",)


@dataclass(frozen=True)
class SparseDecodeConfig:
    """Query-aware sparse decoding (Quest): each decode step, each full-attention layer and KV head attends to
    `token_budget // page_size` pages of `page_size` tokens (a cache block, or an equal part of one): those of the
    first `sink_blocks` blocks, of the last `recent_blocks * block_size` tokens (the query's own page among them)
    and the pages whose upper bound of q.k, from per-page elementwise key minima and maxima, is largest. A step
    whose every context fits the budget runs dense attention; so does any step that holds a prefill chunk or several
    query tokens of one sequence (speculative verification), and so do the first `dense_layers` decoder layers."""

    method: str = "quest"
    token_budget: int = 2048
    sink_blocks: int = 1
    recent_blocks: int = 2
    # Decoder layers below this index stay dense: early layers spread their attention widely, so their outputs
    # lose the most when blocks are dropped.
    dense_layers: int = 0
    # Tokens bounded and selected together; None: the KV block. Smaller pages bound their keys more tightly and
    # waste less of the budget, for block_size // page_size times the bounds' memory and selection reads.
    page_size: int | None = None

    def check(self, block_size: int) -> None:
        """Refuse a page that does not split a block evenly, a budget that is not whole pages, or one that leaves
        no page to choose after sinks and recent ones (rounding the budget would silently change what the caller
        measured)."""
        _check_choice("sparse_decode.method", self.method, SPARSE_DECODE_METHODS)
        _check_int("sparse_decode.sink_blocks", self.sink_blocks, 0)
        _check_int("sparse_decode.recent_blocks", self.recent_blocks, 1)
        _check_int("sparse_decode.dense_layers", self.dense_layers, 0)
        _check_int("sparse_decode.page_size", self.page_size, 2, allow_none=True)
        page = self.page_tokens(block_size)
        if block_size % page or page & (page - 1):
            powers = [1 << i for i in range(1, block_size.bit_length()) if block_size % (1 << i) == 0]
            _fail("sparse_decode.page_size", self.page_size, f"expected a power of two dividing block_size="
                  f"{block_size}: one of {powers}")
        _check_int("sparse_decode.token_budget", self.token_budget, 1)
        unit = "block_size" if self.page_size is None else "page_size"
        if self.token_budget % page:
            _fail("sparse_decode.token_budget", self.token_budget, f"expected a multiple of {unit}={page} "
                  f"(whole pages are selected); use {max(1, self.token_budget // page) * page} or "
                  f"{-(-self.token_budget // page) * page}")
        fixed = (self.sink_blocks + self.recent_blocks) * block_size
        if self.token_budget <= fixed:
            _fail("sparse_decode.token_budget", self.token_budget, f"it must exceed the sink_blocks={self.sink_blocks} "
                  f"+ recent_blocks={self.recent_blocks} blocks it always keeps ({fixed} tokens), so some "
                  f"pages are chosen by the query; use >= {fixed + page} or keep fewer blocks")

    def page_tokens(self, block_size: int) -> int:
        """The page size in tokens."""
        return block_size if self.page_size is None else self.page_size

    def num_selected_pages(self, block_size: int) -> int:
        return self.token_budget // self.page_tokens(block_size)

    @classmethod
    def from_dict(cls, value: Any, block_size: int) -> SparseDecodeConfig:
        _check_config_dict("sparse_decode", value, "{'method': 'quest', 'token_budget': 2048}",
                           [f.name for f in dataclasses.fields(cls)])
        if "method" not in value:
            _fail("sparse_decode.method", None, f"name the method: one of {list(SPARSE_DECODE_METHODS)}")
        config = cls(**value)
        config.check(block_size)
        return config


@dataclass(frozen=True)
class StreamingWindowConfig:
    """Attention sinks + a sliding window (StreamingLLM) on every attention layer: each query attends to the first
    `sink_tokens` tokens of its sequence and the last `window` ones (its own included), with rotary positions
    counted inside that cache, so a sequence may run past max_model_len while its KV stays bounded (the blocks
    that leave the window are freed; the first ceil(sink_tokens / block_size) blocks stay)."""

    sink_tokens: int = 4
    window: int = 1024

    def check(self, max_model_len: int) -> None:
        _check_int("streaming_window.sink_tokens", self.sink_tokens, 0)
        _check_int("streaming_window.window", self.window, 1)
        if max_model_len and self.sink_tokens + self.window > max_model_len:
            _fail("streaming_window.window", self.window, f"sink_tokens + window = {self.sink_tokens + self.window} "
                  f"cache positions exceed max_model_len={max_model_len}, the positions the model is run at; use "
                  f"window <= {max_model_len - self.sink_tokens}")

    @property
    def num_kept_tokens(self) -> int:
        """The most tokens a query attends to; a prompt longer than this is refused."""
        return self.sink_tokens + self.window

    def sink_blocks(self, block_size: int) -> int:
        return -(-self.sink_tokens // block_size)

    @classmethod
    def from_dict(cls, value: Any, max_model_len: int) -> StreamingWindowConfig:
        _check_config_dict("streaming_window", value, "{'sink_tokens': 4, 'window': 1024}",
                           [f.name for f in dataclasses.fields(cls)])
        if "window" not in value:
            _fail("streaming_window.window", None, "give the window (tokens attended after the sinks)")
        config = cls(**value)
        config.check(max_model_len)
        return config


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    device: str = "auto"
    enforce_eager: bool = False
    # Largest token bucket of the prefill / mixed-step CUDA graphs (kestrel.worker.prefill_graph); 0: off;
    # None: DEFAULT_PREFILL_GRAPH_TOKENS where the runner captures CUDA graphs, else off.
    max_prefill_graph_tokens: int | None = None
    # "startup": every CUDA graph is captured before the engine serves; "serving": the engine serves at once and
    # captures one graph before each step and while idle, a step without its graph running eagerly meanwhile;
    # None: "serving", except behind an executor or with a prompt compressor ("startup" there; docs/benchmarks.md,
    # "Serving before the graphs are captured, measured").
    graph_capture: str | None = None
    debug_launch_count: bool = False  # log the kernel launches of one decoder layer's decode step at startup
    disable_log_stats: bool = False  # no periodic throughput / queue / KV cache line in the log
    expert_load_metrics: bool = False  # count the tokens routed to each expert of every MoE layer
    expert_load_interval: int = EXPERT_LOAD_INTERVAL  # steps between the counts' reports to the engine
    cpu_threads: int | None = None  # torch threads of a CPU engine; None: its usable cores less one
    # Processes compiling Triton kernels ahead of the profile run and the graph capture; 0: off (each kernel
    # compiles when it first launches); None: the usable cores less one, at most 8, on a CUDA device that
    # captures graphs.
    compile_workers: int | None = None
    # Processes holding the grammar matchers of structured outputs, each a shard of the constrained requests
    # (kestrel.structured.shards); 0: the engine's own thread advances and fills them; None: half the usable cores,
    # at most 8, for a model runner in this process on a CUDA device, else 0.
    grammar_workers: int | None = None
    speculative_config: dict | None = None  # vLLM's dict; parsed into `speculative`
    speculative: SpeculativeConfig | None = field(default=None, init=False, compare=False)
    sparse_decode: dict | None = None  # {"method": "quest", "token_budget": ...}; parsed into `sparse`
    sparse: SparseDecodeConfig | None = field(default=None, init=False, compare=False)
    streaming_window: dict | None = None  # {"sink_tokens": 4, "window": 1024}; parsed into `streaming`
    streaming: StreamingWindowConfig | None = field(default=None, init=False, compare=False)
    prompt_compressor: str | None = None  # a model directory or "kestrel-tiny"; parsed into `compressor`
    compressor: PromptCompressorConfig | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        if self.prompt_compressor is not None:
            object.__setattr__(self, "compressor", PromptCompressorConfig(self.prompt_compressor))
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative", SpeculativeConfig.from_dict(self.speculative_config))
            self.speculative.check_target(self.model.hf_config, self.model.max_model_len or 0,
                                          self.cache.kv_cache_dtype)
        if self.sparse_decode is not None:
            object.__setattr__(self, "sparse", SparseDecodeConfig.from_dict(self.sparse_decode,
                                                                            self.cache.block_size))
            self._check_sparse_decode()
        if self.streaming_window is not None:
            object.__setattr__(self, "streaming", StreamingWindowConfig.from_dict(self.streaming_window,
                                                                                  self.model.max_model_len or 0))
            self._check_streaming_window()
        _check_choice("device", self.device, DEVICE_CHOICES)
        _check_int("cpu_threads", self.cpu_threads, 1, allow_none=True)
        _check_int("compile_workers", self.compile_workers, 0, allow_none=True)
        _check_int("grammar_workers", self.grammar_workers, 0, allow_none=True)
        if self.compile_workers and self.device == "cpu":
            _fail("compile_workers", self.compile_workers, "it compiles a GPU's Triton kernels; a CPU engine runs "
                  "none, leave it unset or 0")
        if self.cpu_threads is not None and self.device == "cuda":
            _fail("cpu_threads", self.cpu_threads, "it sets a CPU engine's threads; leave it unset with device='cuda'")
        for name in ("enforce_eager", "debug_launch_count", "disable_log_stats", "expert_load_metrics"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "expected True or False")
        self._check_expert_load()
        self._check_prefill_graphs()
        self._check_graph_capture()
        if self.scheduler.max_num_batched_tokens < self.scheduler.max_num_seqs:
            _fail("max_num_batched_tokens", self.scheduler.max_num_batched_tokens,
                  f"must be >= max_num_seqs={self.scheduler.max_num_seqs} so every running request can decode")
        if self.quant.method in CHECKPOINT_ONLY_QUANTIZATION and not self.model.hf_config.get("quantization_config"):
            _fail("quantization", self.quant.method, "it names a checkpoint format, and this checkpoint has no "
                  "quantization_config in its config.json; use 'fp8' or 'int8' to quantize at load")
        self._check_parallel()
        target = self.scheduler.step_time_target_ms
        if target is not None and not self.scheduler.enable_chunked_prefill:
            _fail("step_time_target_ms", target, "it cuts prefill chunks, and chunked prefill is off; drop "
                  "--no-enable-chunked-prefill or the target")
        if target is not None and self.parallel.pipeline_parallel_size > 1:
            _fail("step_time_target_ms", target, "with pipeline_parallel_size > 1 the steps' results interleave "
                  "several batches, so their spacing is not a request's time between tokens; use it with one stage")
        if not self.scheduler.enable_chunked_prefill and (
            self.scheduler.max_num_batched_tokens < (self.model.max_model_len or 0)
        ):
            _fail("max_num_batched_tokens", self.scheduler.max_num_batched_tokens,
                  "without chunked prefill it must be >= max_model_len")

    def _check_parallel(self) -> None:
        """What the sharded model needs of the checkpoint's shapes, and what runs only on one device."""
        hf, tp, pp = self.model.hf_config, self.parallel.tensor_parallel_size, self.parallel.pipeline_parallel_size
        heads = hf.get("num_attention_heads")
        kv_heads = hf.get("num_key_value_heads") or heads
        if tp > 1 and heads:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
            if heads % tp or (kv_heads % tp and tp % kv_heads):
                _fail("tensor_parallel_size", tp, f"it must divide num_attention_heads={heads} and divide or be a "
                      f"multiple of num_key_value_heads={kv_heads}; use one of {divisors}")
            inter = hf.get("intermediate_size")
            if inter and inter % tp:
                _fail("tensor_parallel_size", tp, f"it must divide intermediate_size={inter}")
        layers = hf.get("num_hidden_layers")
        if layers and pp > layers:
            _fail("pipeline_parallel_size", pp, f"the model has num_hidden_layers={layers}; use at most {layers} "
                  "stages")
        spec = self.speculative
        if self.parallel.uses_workers and spec is not None and spec.uses_model:
            _fail("speculative_config.method", spec.method, "draft models and EAGLE heads run in one process; use "
                  "method 'ngram' with tensor/pipeline parallelism or distributed_executor_backend")
        if self.parallel.uses_workers and self.debug_launch_count:
            _fail("debug_launch_count", True, "launch counting runs in the engine's own process; use it without "
                  "tensor/pipeline parallelism or distributed_executor_backend")

    def _check_sparse_decode(self) -> None:
        """Quest bounds keys per head dimension; latent (MLA) layers cache one compressed vector per token, which
        those bounds do not describe."""
        hf = self.model.hf_config
        if hf.get("kv_lora_rank") is not None:
            _fail("sparse_decode", self.sparse_decode, f"{self.model.architecture or 'this model'} uses latent (MLA) "
                  "attention, whose compressed KV cache Quest cannot bound; drop sparse_decode")
        context = self.model.max_model_len or 0
        if context and self.sparse is not None and self.sparse.token_budget >= context:
            _fail("sparse_decode.token_budget", self.sparse.token_budget, f"it covers max_model_len={context}, so "
                  f"every step would run dense attention; use a budget below {context} or drop sparse_decode")

    def _check_streaming_window(self) -> None:
        """What a stream cannot be combined with: the options that read the whole context or run positions past
        the cache (each refused by name, never silently dropped)."""
        others = {"sparse_decode": self.sparse_decode, "speculative_config": self.speculative_config}
        for name, value in others.items():
            if value is not None:
                _fail(name, value, "it is not built for attention sinks + window (streaming_window); use one of them")
        if self.model.hf_config.get("kv_lora_rank") is not None:
            _fail("streaming_window", self.streaming_window, f"{self.model.architecture or 'this model'} uses latent "
                  "(MLA) attention, whose cache the sink + window attention does not read; drop streaming_window")
        if self.model.runner == "pooling":
            _fail("streaming_window", self.streaming_window, "the pooling runner reads whole prompts; use it with "
                  "runner='generate'")

    def _check_prefill_graphs(self) -> None:
        """The prefill graphs' token limit: 0 (off) or a power of two of PREFILL_GRAPH_TOKEN_RANGE, and only where
        CUDA graphs are captured at all (what needs the device or the model is checked by the runner)."""
        limit = self.max_prefill_graph_tokens
        if limit is None:
            return
        low, high = PREFILL_GRAPH_TOKEN_RANGE
        if isinstance(limit, bool) or not isinstance(limit, int) or not (
                limit == 0 or (low <= limit <= high and limit & (limit - 1) == 0)):
            _fail("max_prefill_graph_tokens", limit, f"expected 0 (off) or a power of two from {low} to {high}")
        if limit == 0:
            return
        self._check_graphs_possible("max_prefill_graph_tokens", limit)

    def _check_graphs_possible(self, field_name: str, value: Any) -> None:
        """A CUDA graph setting `field_name` refused where no graph is captured: enforce_eager, several ranks."""
        if self.enforce_eager:
            _fail(field_name, value, "enforce_eager=True turns every CUDA graph off; drop one of them")
        if self.parallel.tensor_parallel_size * self.parallel.pipeline_parallel_size > 1:
            _fail(field_name, value, "CUDA graphs are captured on one device only; use it with "
                  "tensor_parallel_size=1 and pipeline_parallel_size=1")

    def _check_graph_capture(self) -> None:
        """An explicit graph_capture only where CUDA graphs may be captured (the runner refuses what needs the
        device or the model to tell)."""
        if self.graph_capture is None:
            return
        _check_choice("graph_capture", self.graph_capture, GRAPH_CAPTURE_CHOICES)
        self._check_graphs_possible("graph_capture", self.graph_capture)
        if self.device == "cpu":
            _fail("graph_capture", self.graph_capture, "a CPU engine captures no CUDA graphs; leave it unset")
        if self.graph_capture == "serving":
            blocker = self.serving_capture_blocker()
            if blocker is not None:
                _fail("graph_capture", self.graph_capture, blocker)

    def serving_capture_blocker(self) -> str | None:
        """Why this engine's CUDA graphs must be captured at start-up rather than while it serves (an explicit
        graph_capture='serving' is refused with it; an unset one resolves to 'startup'), or None."""
        if self.parallel.uses_workers:
            return ("a runner behind an executor (distributed_executor_backend) captures its graphs at start-up; use "
                    "graph_capture='startup' or no executor")
        if self.prompt_compressor is not None:
            # A capture forbids other threads' allocations on the device, and the compressor's forwards run on a
            # thread of their own.
            return ("prompt compression runs its model on another thread while the engine serves, which a capture "
                    "then cannot allow; use graph_capture='startup' with prompt_compressor")
        return None

    def _check_expert_load(self) -> None:
        interval = self.expert_load_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            _fail("expert_load_interval", interval, "expected an integer >= 1")
        if not self.expert_load_metrics:
            if interval != EXPERT_LOAD_INTERVAL:
                _fail("expert_load_interval", interval, "it paces expert_load_metrics, which is off; set "
                      "expert_load_metrics=True or leave the interval out")
            return
        hf = self.model.hf_config
        if not (hf.get("num_local_experts") or hf.get("num_experts")):
            _fail("expert_load_metrics", True, "expert_load_metrics needs a mixture-of-experts model; "
                  f"{(hf.get('architectures') or ['this model'])[0]} has no experts")
        if self.parallel.pipeline_parallel_size > 1:
            _fail("expert_load_metrics", True, "the counts come from the last pipeline stage, which holds only its "
                  "own layers; use it with pipeline_parallel_size=1")

    @classmethod
    def from_kwargs(cls, model: str, hf_config: dict | None = None, **kwargs: Any) -> EngineConfig:
        """Build from the flat keyword arguments of `LLM(...)` or the CLI; unknown names are an error. `hf_config`:
        the model's config when it is not a config.json (a GGUF file's metadata)."""
        groups: dict[str, dict[str, Any]] = {name: {} for name in ("model", "cache", "scheduler", "parallel", "quant",
                                                                   "engine")}
        for vllm_name, name in _VLLM_SPELLINGS.items():
            if vllm_name in kwargs:
                if name in kwargs:
                    raise ConfigError(f"engine arguments {name}={kwargs[name]!r} and {vllm_name}="
                                      f"{kwargs[vllm_name]!r} are the same setting (vLLM's spelling and kestrel's); "
                                      "give one")
                kwargs[name] = kwargs.pop(vllm_name)
        for key, value in kwargs.items():
            if key not in _KWARG_TO_FIELD and _engine_arg_asks_nothing(key, value):
                continue
            if key in NOT_SUPPORTED_ENGINE_ARGS:
                reason = NOT_SUPPORTED_ENGINE_ARGS[key]
                raise ConfigError(f"engine argument {key}={value!r} is not supported: {reason}; remove it")
            if key not in _KWARG_TO_FIELD:
                known = ", ".join(sorted(_KWARG_TO_FIELD))
                raise ConfigError(f"unknown engine argument {key!r}; known arguments: {known}")
            group, name = _KWARG_TO_FIELD[key]
            if key == "dtype" and type(value).__name__ == "dtype" and type(value).__module__ == "torch":
                value = str(value).removeprefix("torch.")  # LLM(dtype=torch.bfloat16), as vLLM takes it
            groups[group][name] = value
        return cls(
            model=ModelConfig(model=model, hf_config=hf_config or {}, **groups["model"]),
            cache=CacheConfig(**groups["cache"]),
            scheduler=SchedulerConfig(**groups["scheduler"]),
            parallel=ParallelConfig(**groups["parallel"]),
            quant=QuantConfig(**groups["quant"]),
            **groups["engine"],
        )

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class EngineArg:
    """One engine argument: its `LLM(...)` keyword (and CLI flag, `--` + dashes), the config field it sets, and
    the flag's help. The CLI's engine flags are generated from this table, so the two cannot drift apart."""

    name: str
    group: str  # the EngineConfig part: model, cache, scheduler, parallel, quant, or engine (EngineConfig itself)
    field: str
    help: str
    aliases: tuple[str, ...] = ()  # more CLI spellings (vLLM's short flags)
    choices: tuple[Any, ...] | None = None
    vllm_name: str | None = None  # vLLM's name where it differs: accepted by LLM(...) and as a flag too


ENGINE_ARGS: tuple[EngineArg, ...] = (
    EngineArg("tokenizer", "model", "tokenizer", "tokenizer directory (default: the model's)"),
    EngineArg("dtype", "model", "dtype", "weights and activations dtype; auto: the checkpoint's",
              choices=DTYPE_CHOICES + tuple(DTYPE_ALIASES)),
    EngineArg("load_format", "model", "load_format", "auto: safetensors if present, else pytorch_model*.bin (pt); "
              "dummy: random weights of the checkpoint's shapes",
              choices=LOAD_FORMAT_CHOICES),
    EngineArg("seed", "model", "seed", "seed of dummy weights and of unseeded sampling"),
    EngineArg("max_model_len", "model", "max_model_len", "context length (default: the model's)"),
    EngineArg("generation_config", "model", "generation_config",
              "auto: the model's generation_config.json gives extra EOS ids and default sampling settings; vllm: "
              "ignore it; or a directory holding one"),
    EngineArg("download_dir", "model", "download_dir",
              "Hugging Face hub cache in which a model id (org/name) is looked up (default: HF_HUB_CACHE, "
              "HF_HOME/hub, ~/.cache/huggingface/hub); nothing is downloaded"),
    EngineArg("trust_remote_code", "model", "trust_remote_code",
              "let a tokenizer run the code its directory ships (model architectures are kestrel's own)"),
    EngineArg("hf_overrides", "model", "hf_overrides", "config.json keys to replace, as JSON (e.g. "
              "'{\"rope_theta\": 1000000}')"),
    EngineArg("max_logprobs", "model", "max_logprobs",
              "most logprobs (and prompt_logprobs) a request may ask for; -1: the whole vocabulary"),
    EngineArg("runner", "model", "runner",
              "generate: text generation; pooling: embeddings (/v1/embeddings, /pooling, /score by cosine) or, for a "
              "*ForSequenceClassification checkpoint, scores (/score, /rerank, /classify, /pooling); auto: pooling "
              "for a classification checkpoint, else generate", choices=RUNNER_CHOICES),
    EngineArg("pooler_config", "model", "pooler_config",
              "the pooling runner's pooling, overriding the checkpoint's (modules.json), as JSON: "
              "'{\"pooling_type\": \"MEAN\", \"normalize\": true}' (pooling_type LAST, MEAN or CLS)",
              vllm_name="override_pooler_config"),
    EngineArg("limit_mm_per_prompt", "model", "limit_mm_per_prompt",
              "multimodal models: most items of each modality per prompt, as JSON: '{\"image\": 2}' (default "
              f"{DEFAULT_MM_PER_PROMPT}); a prompt with more is refused"),
    EngineArg("mm_processor_kwargs", "model", "mm_processor_kwargs",
              "multimodal models: settings of the checkpoint's image processor, as JSON (e.g. '{\"do_center_crop\": "
              "false}'); a key the processor does not have is refused"),
    EngineArg("allowed_local_media_path", "model", "allowed_local_media_path",
              "multimodal models: a directory whose files requests may name as file:// image URLs (default: none)"),
    EngineArg("allowed_media_domains", "model", "allowed_media_domains",
              "multimodal models: domains whose http(s) image URLs are fetched (default: none; remote fetching is "
              "off)"),
    EngineArg("block_size", "cache", "block_size", "tokens per KV cache block", choices=BLOCK_SIZE_CHOICES),
    EngineArg("kv_cache_blocks", "cache", "kv_cache_blocks", "number of KV cache blocks (instead of the profiled "
              "one)", vllm_name="num_gpu_blocks_override"),
    EngineArg("enable_prefix_caching", "cache", "enable_prefix_caching", "reuse the KV of shared prompt prefixes"),
    EngineArg("kv_cache_dtype", "cache", "kv_cache_dtype", "KV cache element type (fp8: E4M3)",
              choices=KV_CACHE_DTYPE_CHOICES + tuple(KV_CACHE_DTYPE_ALIASES)),
    EngineArg("gpu_memory_utilization", "cache", "gpu_memory_utilization",
              "fraction of GPU memory for weights, activations and the KV cache"),
    EngineArg("cpu_kv_cache_bytes", "cache", "cpu_kv_cache_bytes", "KV cache bytes on the CPU"),
    EngineArg("kv_cache_memory_bytes", "cache", "kv_cache_memory_bytes",
              "absolute KV cache budget in bytes (instead of the fraction)"),
    EngineArg("encoder_cache_size", "cache", "encoder_cache_size",
              "multimodal models: the encoder cache's bound in embedding rows (an image's placeholder tokens each)"),
    EngineArg("calculate_kv_scales", "cache", "calculate_kv_scales",
              "with --kv-cache-dtype fp8: measure each layer's k_scale / v_scale at start-up (amax / 448 of a "
              "calibration prefill of random token ids, before the CUDA graphs are captured) instead of taking the "
              "checkpoint's, or 1.0 where it has none"),
    EngineArg("max_num_batched_tokens", "scheduler", "max_num_batched_tokens", "token budget of one step (a CPU "
              "engine of a text model with chunked prefill: 512 unless given)"),
    EngineArg("max_num_seqs", "scheduler", "max_num_seqs", "most sequences in the running batch"),
    EngineArg("enable_chunked_prefill", "scheduler", "enable_chunked_prefill",
              "split long prefills across steps within the token budget"),
    EngineArg("async_scheduling", "scheduler", "async_scheduling",
              "overlap the host side of each step with the device work of the previous one (default: on for a GPU)"),
    EngineArg("scheduling_policy", "scheduler", "policy",
              "fcfs: first come, first served; priority: requests with a lower priority value first, and the "
              "lowest-priority running request is preempted first; shortest_prefill: within a priority, the "
              "shortest prompt is admitted first (lower TTFT tail under a mix of prompt lengths), bounded by "
              "--scheduling-starvation-bound", choices=SCHEDULING_POLICY_CHOICES),
    EngineArg("scheduling_starvation_bound", "scheduler", "starvation_bound",
              "shortest_prefill only: once this many requests were admitted since a request arrived, it goes "
              "before every later arrival of its priority (default 64)"),
    EngineArg("step_time_target_ms", "scheduler", "step_time_target_ms",
              "aim each step that carries decoding requests at this many milliseconds, their time between tokens: "
              "decodes first, prefill chunks cut to what the measured step cost leaves (default: off, every step "
              "takes up to --max-num-batched-tokens)"),
    EngineArg("tensor_parallel_size", "parallel", "tensor_parallel_size", "GPUs per model replica", aliases=("-tp",)),
    EngineArg("pipeline_parallel_size", "parallel", "pipeline_parallel_size", "pipeline stages", aliases=("-pp",)),
    EngineArg("distributed_executor_backend", "parallel", "distributed_executor_backend",
              "worker processes: mp (spawned on this machine) or ray (actors on a Ray cluster, multi-node); "
              "default: in-process on one device, mp on several", choices=DISTRIBUTED_EXECUTOR_BACKEND_CHOICES),
    EngineArg("enable_expert_parallel", "parallel", "enable_expert_parallel",
              "mixture-of-experts layers: each tensor-parallel rank holds whole experts (E / tp of them) instead of "
              "a slice of every expert; a model without experts is unaffected"),
    EngineArg("distributed_timeout_s", "parallel", "distributed_timeout_s",
              "seconds to wait for a worker (group setup, one step) before failing; a dead worker fails at once"),
    EngineArg("quantization", "quant", "method",
              "fp8 or int8: W8A8 quantized at load; a quantized checkpoint (compressed-tensors, fp8, gptq, awq, "
              "bitsandbytes) loads as saved without it", aliases=("-q",), choices=QUANTIZATION_CHOICES),
    EngineArg("activation_scheme", "quant", "activation_scheme", "W8A8 activation scales",
              choices=ACTIVATION_SCHEME_CHOICES),
    EngineArg("symmetric_activations", "quant", "symmetric_activations", "INT8 activations without a zero point"),
    EngineArg("fp8_block_activations", "quant", "fp8_block_activations",
              "the dense layers of a block-FP8 checkpoint (weight_block_size, FP8_BLOCK): model_dtype keeps their "
              "inputs in the model dtype on the weight-only kernel; fp8 quantizes them per token and block as the "
              "checkpoint says, on the W8A8 block GEMM", choices=FP8_BLOCK_ACTIVATION_CHOICES),
    EngineArg("device", "engine", "device", "where the model runs", choices=DEVICE_CHOICES),
    EngineArg("enforce_eager", "engine", "enforce_eager", "no CUDA graphs"),
    EngineArg("max_prefill_graph_tokens", "engine", "max_prefill_graph_tokens",
              "CUDA graphs for prefill and mixed steps of up to this many tokens (power-of-two token buckets from "
              "16; 0: off, prefills run eagerly; default: 512 where the engine captures CUDA graphs, else off); a GPU "
              "with CUDA graphs on only (docs/kernels-attention.md)"),
    EngineArg("graph_capture", "engine", "graph_capture",
              "when the CUDA graphs are captured: serving (the engine serves at once and captures one graph before "
              "each step and while idle; a step whose graph is not captured yet runs eagerly) or startup (all of "
              "them before the engine serves); default: serving, startup behind an executor or with a prompt "
              "compressor",
              choices=GRAPH_CAPTURE_CHOICES),
    EngineArg("cpu_threads", "engine", "cpu_threads", "torch threads of a CPU engine (default: the cores it may "
              "use, less one for the engine loop)"),
    EngineArg("compile_workers", "engine", "compile_workers",
              "processes that compile the GPU's Triton kernels in parallel before the memory profile and the CUDA "
              "graph capture, each kernel's launch recorded on a dry forward first (0: off, each kernel compiles "
              "when it first launches; default: the usable cores less one, at most 8, where graphs are captured)"),
    EngineArg("grammar_workers", "engine", "grammar_workers",
              "processes that hold the grammar matchers of structured outputs, each a shard of the constrained "
              "requests, advancing them and filling their token masks beside each other instead of on the engine's "
              "thread (0: on the engine's thread; default: half the usable cores, at most 8, for one GPU in the "
              "engine's process, else 0)"),
    EngineArg("debug_launch_count", "engine", "debug_launch_count",
              "log the kernel launches of one decoder layer's decode step"),
    EngineArg("speculative_config", "engine", "speculative_config",
              "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5, \"disable_by_batch_size\": 16}, or "
              "{\"method\": \"draft_model\" | \"eagle\", \"model\": PATH, \"num_speculative_tokens\": 4}"),
    EngineArg("sparse_decode", "engine", "sparse_decode",
              "query-aware sparse decoding, as JSON: {\"method\": \"quest\", \"token_budget\": 2048, "
              "\"sink_blocks\": 1, \"recent_blocks\": 2, \"dense_layers\": 0, \"page_size\": null}; each decode step "
              "reads token_budget tokens of the KV cache per layer and KV head (docs/long-context.md)"),
    EngineArg("streaming_window", "engine", "streaming_window",
              "attention sinks + sliding window (StreamingLLM) on every layer, as JSON: {\"sink_tokens\": 4, "
              "\"window\": 1024}; sequences may run past max_model_len with bounded KV, each query attending to the "
              "first sink_tokens and last window tokens at positions inside that cache (docs/long-context.md)"),
    EngineArg("prompt_compressor", "engine", "prompt_compressor",
              "prompt compression (requests' prompt_compression option, off unless this is given): the small "
              "causal LM that scores prompt tokens, a model directory or 'kestrel-tiny' for the bundled one; it "
              "runs beside the served model on its device (docs/long-context.md)"),
    EngineArg("disable_log_stats", "engine", "disable_log_stats",
              "no periodic log line of throughput, running / waiting requests and KV cache usage"),
    EngineArg("expert_load_metrics", "engine", "expert_load_metrics",
              "mixture-of-experts models: count the tokens routed to each expert of each layer (the "
              "kestrel:moe_expert_tokens_total series, LLM.get_expert_load())"),
    EngineArg("expert_load_interval", "engine", "expert_load_interval",
              "with expert_load_metrics: steps between the counts' copies to the engine (the metrics' staleness)"),
)
_KWARG_TO_FIELD: dict[str, tuple[str, str]] = {arg.name: (arg.group, arg.field) for arg in ENGINE_ARGS}
_VLLM_SPELLINGS: dict[str, str] = {arg.vllm_name: arg.name for arg in ENGINE_ARGS if arg.vllm_name}

# vLLM engine arguments kestrel does not have, with the reason (LLM(**kwargs) and the CLI refuse them by name).
NOT_SUPPORTED_ENGINE_ARGS: dict[str, str] = {
    "swap_space": "kestrel preempts by recomputation and keeps no CPU swap space",
    "cpu_offload_gb": "weights are not offloaded to the CPU; the whole model lives on the device",
    "preemption_mode": "kestrel always preempts by recomputation",
    "enable_lora": "LoRA adapters are not supported; merge the adapter into the weights",
    "max_loras": "LoRA adapters are not supported", "max_lora_rank": "LoRA adapters are not supported",
    "structured_outputs_config": "kestrel compiles every structured output with xgrammar (backend 'xgrammar' or "
                                 "'auto' ask for that), configured by the server's grammar limits",
    "guided_decoding_backend": "kestrel compiles every structured output with xgrammar ('xgrammar' or 'auto' ask "
                               "for that)",
    "data_parallel_size": "run one server per replica behind a load balancer",
    "revision": "kestrel does not download; name the snapshot directory (or the cache's refs/main) instead",
    "tokenizer_revision": "kestrel does not download; pass --tokenizer DIR",
    "code_revision": "kestrel does not download model code",
    "hf_token": "kestrel does not download, so it needs no Hugging Face token",
    "tokenizer_mode": "kestrel loads the fast (tokenizers) tokenizer a model directory has",
    "skip_tokenizer_init": "kestrel needs the tokenizer (stop strings, detokenization)",
    "max_seq_len_to_capture": "CUDA graphs cover the decode batch sizes up to max_num_seqs; enforce_eager turns "
                              "them off",
    "compilation_config": "kestrel's kernels are its own Triton kernels, with CUDA graphs (enforce_eager turns them "
                          "off); there is no torch.compile configuration",
    "enable_prompt_embeds": "prompt embeddings are not supported",
    "task": "vLLM's older spelling; use runner='pooling' (--runner pooling), and the checkpoint's architecture "
            "decides between embeddings and classification",
    "kv_transfer_config": "KV transfer (disaggregated prefill) is not implemented",
    "enable_sleep_mode": "sleep mode is not implemented",
    "rope_scaling": "pass it through hf_overrides ({'rope_scaling': ...})",
    "rope_theta": "pass it through hf_overrides ({'rope_theta': ...})",
    "override_generation_config": "put the settings in a generation_config.json and pass generation_config=DIR",
    "logprobs_mode": "logprobs are the raw model's (vLLM's raw_logprobs)",
    "served_model_name": "it names the model in the server; pass --served-model-name to kestrel serve",
    "disable_custom_all_reduce": "tensor parallelism all-reduces through torch.distributed (NCCL, gloo); kestrel has "
                                 "no custom all-reduce to turn off",
    "max_parallel_loading_workers": "each rank loads its own shard of the checkpoint",
    "cuda_graph_sizes": "the decode graphs cover the batch sizes up to max_num_seqs, and the prefill graphs up to "
                        "max_prefill_graph_tokens; enforce_eager turns them off",
    "model_impl": "kestrel runs its own implementation of each architecture it lists",
    "long_prefill_token_threshold": "a step's prefill tokens are max_num_batched_tokens at most; step_time_target_ms "
                                    "bounds a step's time",
    "logits_processors": "custom logits processors are not implemented",
    "tokenizer_pool_size": "the server tokenizes in --tokenizer-workers processes",
    "otlp_traces_endpoint": "OpenTelemetry tracing is not implemented; /metrics serves Prometheus metrics",
}
# vLLM engine arguments at a value that asks for what kestrel does anyway: accepted, since nothing is ignored.
_ENGINE_ARG_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "swap_space": (0,), "cpu_offload_gb": (0,), "enable_lora": (False,), "skip_tokenizer_init": (False,),
    "tokenizer_mode": ("auto",), "task": ("auto", "generate"),
    "preemption_mode": (None, "recompute"), "logprobs_mode": ("raw_logprobs",), "revision": (None, "main"),
    "enable_prompt_embeds": (False,),
    "enable_sleep_mode": (False,), "data_parallel_size": (1,),
    "enable_expert_parallel": (False,), "hf_token": (None,), "compilation_config": (None,),
    "guided_decoding_backend": ("xgrammar", "auto"),
    "structured_outputs_config": ({"backend": "xgrammar"}, {"backend": "auto"}),
    "disable_custom_all_reduce": (True, False), "max_parallel_loading_workers": (None,), "model_impl": ("auto",),
    "long_prefill_token_threshold": (0,), "logits_processors": (None,), "tokenizer_pool_size": (0,),
    "otlp_traces_endpoint": (None,), "cuda_graph_sizes": (None,),
}


def _engine_arg_asks_nothing(key: str, value: Any) -> bool:
    return any(type(value) is type(v) and value == v for v in _ENGINE_ARG_NO_OP_VALUES.get(key, ()))
_GROUP_CLASSES: dict[str, type] = {}  # filled below, once the classes exist


def engine_arg_default(arg: EngineArg) -> Any:
    for f in dataclasses.fields(_GROUP_CLASSES[arg.group]):
        if f.name == arg.field:
            return f.default if f.default is not dataclasses.MISSING else None
    raise KeyError(arg.field)


def field_kind(cls: type, name: str) -> Any:
    """The type of a dataclass field with `| None` left out: int, float, str, bool, dict, tuple[str, ...]."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType):
        return next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


def engine_arg_type(arg: EngineArg) -> Any:
    return field_kind(_GROUP_CLASSES[arg.group], arg.field)


_GROUP_CLASSES.update(model=ModelConfig, cache=CacheConfig, scheduler=SchedulerConfig, parallel=ParallelConfig,
                      quant=QuantConfig, engine=EngineConfig)
