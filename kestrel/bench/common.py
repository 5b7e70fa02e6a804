"""Shared pieces of the end-to-end suites (latency, throughput): model directories, engine construction,
the HF transformers peer launched in a child process, ceilings, environment and result writing.

Kestrel and HF transformers must run the *same* random weights, so for the Llama-3-8B architecture the
weights are drawn once on the GPU and written as an HF safetensors checkpoint that both load. The HF
peer runs in a child process so that its memory (and torch.compile's CUDA-graph pools) are gone before
kestrel sizes its KV cache from free memory.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kestrel.bench import attention as attn_bench
from kestrel.bench.hf_peer import median as median
from kestrel.bench.hf_peer import percentile as percentile
from kestrel.bench.hf_peer import random_prompts as random_prompts
from kestrel.config import GRAPH_CAPTURE_CHOICES, ConfigError, EngineConfig, is_gguf_model, resolve_model_path
from kestrel.engine.core import EngineCore
from kestrel.executor.factory import build_executor
from kestrel.loader.model_init import _write_weights, checkpoint_shapes, write_tiny_checkpoint
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.structured.shards import engine_grammar_backend, start_grammar_workers_early
from kestrel.worker.model_runner import ModelRunner
from kestrel.worker.runner_setup import compile_pool_started_early, runs_on_cpu

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 128000, "eos_token_id": 128001,
    "torch_dtype": "bfloat16", "use_cache": True,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
# Llama-3-70B's shape with the 8B entry's rope (llama3 scaling, theta 500k) and vocabulary: 140 GB of BF16
# weights, so on an H200 it needs two ranks in BF16, or W8A8 (70 GB) on one.
LLAMA3_70B: dict[str, Any] = {
    **LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
}
# Qwen3-8B's and Gemma-2-9B's published shapes (config.json of the released checkpoints).
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_cache": True,
}
GEMMA2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
    "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "vocab_size": 256000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "initializer_range": 0.02, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "bfloat16",
    "use_cache": True,
}
# Qwen3-30B-A3B's and Mixtral-8x7B's published shapes: 128 experts choose 8 (3.3B active parameters of 30.5B), and
# 8 choose 2 (12.9B of 46.7B).
QWEN3_30B_A3B: dict[str, Any] = {
    **QWEN3_8B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False,
}
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
    "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "output_router_logits": False,
    "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16", "use_cache": True,
}
ARCHS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "qwen3-8b": QWEN3_8B, "gemma2-9b": GEMMA2_9B,
         "qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B}
# Random weight-only checkpoints (--weight-only): compressed-tensors pack-quantized, symmetric integer codes.
WEIGHT_ONLY_BITS = {"w4a16": 4, "w8a16": 8}
# ... or a GGUF file in one of llama.cpp's type mixes (`gguf_mix_type`).
GGUF_MIXES = ("gguf-q4_k_m", "gguf-q8_0", "gguf-q4_0")
WEIGHT_ONLY_GROUP = 128  # the compressed-tensors checkpoints' default group
SMOKE_OVERRIDES: dict[str, Any] = {"max_position_embeddings": 512}
# Batch-1 decode target of precisions without their own (latency.DECODE_ROOFLINE_FACTORS): x the roofline.
ROOFLINE_FACTOR = 1.3


# ------------------------------------------------------------------------------------------------ models


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a count of prompts, tokens or rounds that must not be empty)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def write_random_checkpoint(path: Path, config: dict[str, Any], device: torch.device, seed: int = 0) -> None:
    """HF-named random weights (std 0.02, norms 1 + N(0, 0.02)) drawn on `device`, saved as safetensors.
    Reused when `path` already holds a checkpoint of the same config."""
    if has_checkpoint(path, config):
        return
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    dtype = getattr(torch, config["torch_dtype"])
    tensors = {name: random_dense(name, shape, config, gen, device, dtype)
               for name, shape in checkpoint_shapes(config).items()}
    save_random_checkpoint(path, tensors, config)


def random_dense(name: str, shape: Sequence[int], config: dict[str, Any], gen: torch.Generator,
                 device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One HF tensor of a random checkpoint, on the host: std `initializer_range`, norms 1 + that."""
    values = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(config["initializer_range"])
    if name.endswith("norm.weight"):
        values += 1.0
    return values.to(dtype).cpu()


def save_random_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_weights(path, tensors, num_shards=max(1, total // (4 << 30)))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors.clear()
    release(None)  # the engine sizes its KV cache from free device memory


def write_random_weight_only_checkpoint(path: Path, config: dict[str, Any], bits: int, group_size: int,
                                        device: torch.device, seed: int = 0) -> dict[str, Any]:
    """`write_random_checkpoint` with every `*_proj` linear layer as compressed-tensors `pack-quantized` symmetric
    `bits`-bit codes (uniform random words), per-group BF16 scales sized so that the weights' std is about 0.02;
    returns the config written (with its quantization_config)."""
    grouped = group_size > 0
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False,
               "strategy": "group" if grouped else "channel", "group_size": group_size if grouped else None,
               "actorder": None}
    quantized = {**config, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "quantization_status": "compressed", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": weights, "input_activations": None, "format": "pack-quantized"}}}}
    if has_checkpoint(path, quantized):
        return quantized
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    dtype = getattr(torch, config["torch_dtype"])
    code_std = (((1 << bits) ** 2 - 1) / 12) ** 0.5  # of codes uniform over [-2^(b-1), 2^(b-1))
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_shapes(config).items():
        module = name.removesuffix(".weight")
        if name.endswith("_proj.weight") and len(shape) == 2:
            n, k = shape
            words = torch.randint(-(1 << 31), 1 << 31, (n, k * bits // 32), generator=gen, device=device,
                                  dtype=torch.int64).to(torch.int32)
            groups = k // group_size if grouped else 1
            scale = torch.rand((n, groups), generator=gen, device=device).add_(0.5).mul_(0.02 / code_std)
            tensors[f"{module}.weight_packed"] = words.cpu()
            tensors[f"{module}.weight_scale"] = scale.to(dtype).cpu()
            tensors[f"{module}.weight_shape"] = torch.tensor([n, k])
            continue
        tensors[name] = random_dense(name, shape, config, gen, device, dtype)
    save_random_checkpoint(path, tensors, quantized)
    return quantized


def gguf_mix_type(mix: str, name: str, num_layers: int) -> str:
    """The GGML type of GGUF tensor `name` in `mix`. Q4_K_M as llama.cpp's quantizer makes it: Q4_K, but Q6_K for
    the LM head and, in a layer that gets more bits (the first and last eighth of the layers and every third one
    between), for the V and down projections. Q8_0 and Q4_0 keep the LM head in Q6_K, as llama.cpp does for Q4_0."""
    parts = name.split(".")
    if name == "output.weight":
        return "Q8_0" if mix == "gguf-q8_0" else "Q6_K"
    if mix != "gguf-q4_k_m":
        return mix.removeprefix("gguf-").upper()
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        layer, eighth = int(parts[1]), num_layers // 8
        if layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def write_random_gguf(path: Path, config: dict[str, Any], mix: str, seed: int = 0) -> None:
    """A GGUF file of random blocks (`gguf_export.random_blocks`) in `mix`, with `config`'s shapes and kestrel-tiny's
    tokenizer (its token list padded to the vocabulary); reused when `path` holds one of the same config and mix.
    GGUFWriter holds the tensors in memory until it writes them."""
    import gguf

    from kestrel.quant import gguf_export
    from kestrel.tiny import default_model_path

    marker = path.with_suffix(".json")
    spec = {"config": config, "mix": mix, "seed": seed}
    if path.is_file() and marker.is_file() and json.loads(marker.read_text()) == spec:
        return
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(default_model_path()) / name, hf_dir / name)
        (hf_dir / "config.json").write_text(json.dumps(config))

        def encode(values: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
            if type_name == "F32":
                return np.ones(values.shape, np.float32), None
            return gguf_export.random_blocks(rng, *values.shape, type_name), gguf.GGMLQuantizationType[type_name]

        # Zero-stride stand-ins: the encoder reads only their shapes.
        shapes = ((name, np.broadcast_to(np.float32(0), shape)) for name, shape in checkpoint_shapes(config).items())
        path.parent.mkdir(parents=True, exist_ok=True)
        gguf_export.write_gguf(path, hf_dir, shapes,
                               lambda name: gguf_mix_type(mix, name, config["num_hidden_layers"]), encoder=encode)
    marker.write_text(json.dumps(spec))


def has_checkpoint(path: Path, config: dict[str, Any]) -> bool:
    marker = path / "config.json"
    return marker.is_file() and json.loads(marker.read_text()) == config and any(path.glob("*.safetensors"))


def default_weights_dir(arch: str) -> Path:
    """Where `--arch`'s random checkpoint (or config.json alone) goes when `--weights-dir` is not given: one
    directory per architecture, so that one's config never replaces another's checkpoint."""
    return Path(f"/tmp/kestrel-bench-{arch}")


def temporary_dir(prefix: str) -> Path:
    """A fresh directory removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def prepare_model(model: str | None, arch: str, smoke: bool, weights_dir: Path | None, with_checkpoint: bool,
                  device: torch.device, weight_only: str | None = None,
                  group_size: int | None = None) -> tuple[str, str]:
    """(model directory or GGUF file, load_format). `--model` wins; `--smoke` writes a tiny checkpoint;
    `weight_only` a random weight-only checkpoint (or GGUF file) of the architecture; otherwise the architecture's
    random checkpoint when the HF peer needs it or an earlier run left it (loading it is faster than drawing dummy
    weights on the CPU), else its config.json alone with load_format="dummy"."""
    if weight_only is not None and (model or smoke):
        raise ConfigError(f"invalid --weight-only={weight_only}: it writes random weights of --arch, so it goes "
                          "without --model and --smoke")
    if group_size is not None and weight_only not in WEIGHT_ONLY_BITS:
        raise ConfigError(f"invalid --group-size={group_size}: it sets the group of --weight-only "
                          f"{'/'.join(sorted(WEIGHT_ONLY_BITS))} checkpoints"
                          + (f"; {weight_only}'s groups are its types' own" if weight_only else ""))
    if weight_only in GGUF_MIXES:
        from kestrel.loader.gguf_weights import ARCHITECTURES

        if ARCHS[arch]["model_type"] not in ARCHITECTURES:
            raise ConfigError(f"invalid --weight-only={weight_only} with --arch {arch}: GGUF files of "
                              f"{sorted(ARCHITECTURES)} dense models load; choose such an --arch")
        if with_checkpoint:
            raise ConfigError(f"invalid --weight-only={weight_only} with the HF peer: transformers would dequantize "
                              "the whole GGUF file; use --hf-peer none (latency) / --hf-peer-prompts 0 (throughput)")
        path = (weights_dir or default_weights_dir(f"{arch}-{weight_only}")) / "model.gguf"
        write_random_gguf(path, ARCHS[arch], weight_only)
        return str(path), "auto"
    if weight_only is not None:
        group_size = WEIGHT_ONLY_GROUP if group_size is None else group_size
        weights_dir = weights_dir or default_weights_dir(f"{arch}-{weight_only}-g{group_size}")
        write_random_weight_only_checkpoint(weights_dir, ARCHS[arch], WEIGHT_ONLY_BITS[weight_only], group_size,
                                            device)
        return str(weights_dir), "auto"
    if model:
        model = resolve_model_path(model)  # a Hugging Face id from the local cache, or a ConfigError naming it
        if not is_gguf_model(model) and not (Path(model) / "config.json").is_file():
            raise ConfigError(f"invalid model={model!r}: no config.json there; pass a Hugging Face model directory "
                              "or a GGUF file (or --arch for random weights of a known shape)")
        return model, "auto"
    if smoke:
        # a directory of the run's own unless given: the architecture's default holds its real random checkpoint,
        # and concurrent smoke runs would write one tiny checkpoint over another's
        weights_dir = weights_dir or temporary_dir("kestrel-bench-smoke-")
        write_tiny_checkpoint(weights_dir, "llama", "tiny", **SMOKE_OVERRIDES)
        return str(weights_dir), "auto"
    weights_dir = weights_dir or default_weights_dir(arch)
    config = ARCHS[arch]
    if with_checkpoint or has_checkpoint(weights_dir, config):
        write_random_checkpoint(weights_dir, config, device)
        return str(weights_dir), "auto"
    weights_dir.mkdir(parents=True, exist_ok=True)
    (weights_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(weights_dir), "dummy"


class NullTokenizer:
    """Stands in for a tokenizer when the model directory has none (random-weight architectures): outputs
    are token ids, and detokenization is a no-op."""

    all_special_ids: list[int] = []
    eos_token_id = None

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [""] * len(ids)

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        return ""

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return ""


@dataclass
class Engine:
    core: EngineCore
    runner: ModelRunner
    config: EngineConfig
    build_s: float  # until the engine serves
    started: float  # perf_counter() when the build began
    graphs_ready_s: float | None = None  # until every CUDA graph was captured (`finish_graphs`)

    def finish_graphs(self) -> None:
        """Capture the CUDA graphs still pending (graph_capture="serving"), so that timed steps replay them;
        `graphs_ready_s`: from the build's start to the last graph's capture (None without graphs)."""
        self.core.finish_idle_work()
        synchronize(self.runner.device)
        ready_at = getattr(self.runner, "graphs_ready_at", None)
        self.graphs_ready_s = None if ready_at is None else ready_at - self.started


def build_engine(model: str, capture_graphs_now: bool = True, **engine_args: Any) -> Engine:
    """`capture_graphs_now`: capture every CUDA graph before returning (outside `build_s`), for benchmarks that
    time steps from the start; False leaves them to the engine's steps (and to `Engine.finish_graphs`)."""
    from kestrel.loader.gguf_config import model_hf_config

    started = time.perf_counter()
    # A GGUF file carries its config and tokenizer: both are read from it here, as a server's start-up does.
    if engine_args.get("kv_cache_dtype") == "fp8":
        # Random weights have no checkpoint scales, and 1.0 would waste FP8 range: the runner measures them before
        # it captures its graphs (each tensor-parallel rank or pipeline stage its own layers' and kv heads').
        engine_args.setdefault("calculate_kv_scales", True)
    config = EngineConfig.from_kwargs(model, hf_config=model_hf_config(model), **engine_args)
    with compile_pool_started_early(config):
        tokenizer: Any = NullTokenizer()
        if is_gguf_model(config.model.tokenizer_path) or has_tokenizer(config.model.tokenizer_path):
            tokenizer = load_tokenizer(config.model.tokenizer_path)
        elif config.grammar_workers:
            raise ConfigError(f"invalid grammar_workers={config.grammar_workers}: {config.model.tokenizer_path} has "
                              "no tokenizer for the grammars' vocabulary; pass one (--tokenizer DIR) or leave it 0")
        eos = tokenizer.eos_token_id
        if not isinstance(tokenizer, NullTokenizer):
            start_grammar_workers_early(config, on_cuda=not runs_on_cpu(config.device))
        runner: Any = (build_executor(config, eos) if config.parallel.uses_workers
                       else ModelRunner(config, eos_token_id=eos))
    # The engine's own structured-outputs backend, as LLM builds it (grammar workers included), where there is a
    # vocabulary to build grammars from.
    structured = None if isinstance(tokenizer, NullTokenizer) else engine_grammar_backend(config, runner, tokenizer)
    core = EngineCore(config, runner, runner.kv_layout, tokenizer, eos, structured)
    synchronize(runner.device)
    engine = Engine(core, runner, config, time.perf_counter() - started, started)
    if capture_graphs_now:
        engine.finish_graphs()
    return engine


def release(engine: Engine | None) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: Any) -> None:
    # An executor's device is in its workers, which answer only once a step is done: nothing to wait for here.
    if isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.synchronize(device)


def has_tokenizer(directory: str) -> bool:
    return any((Path(directory) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def prompt_vocab(model_dir: str, tokenizer_dir: str | None = None) -> int:
    """Prompt token ids must be valid for the model and, when there is one, its tokenizer (`tokenizer_dir`, by
    default the model's directory; a GGUF file's own token list covers its vocabulary)."""
    if is_gguf_model(model_dir):
        from kestrel.loader.gguf_config import model_hf_config

        vocab = int(model_hf_config(model_dir)["vocab_size"])
        if tokenizer_dir is None:
            return vocab
    else:
        vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    tokenizer_file = Path(tokenizer_dir or model_dir) / "tokenizer.json"
    if tokenizer_file.is_file():
        vocab = min(vocab, len(json.loads(tokenizer_file.read_text())["model"]["vocab"]))
    return vocab


# ------------------------------------------------------------------------------------------------ model bytes


def runner_weight_bytes(runner: Any) -> dict[str, int]:
    """`weight_bytes` of the runner's model, in this process or (executor) as its rank 0 reported them."""
    return weight_bytes(runner.model) if isinstance(runner, ModelRunner) else dict(runner.weight_bytes)


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the parameters (weights, their scales, norms; not buffers such as rope tables, of which a
    step reads only its positions' rows); `per_step` also leaves out the embedding table, for the same reason.
    A mixture of experts adds `experts` (the bytes of every expert, a part of `per_step`), and its `num_experts`
    and `top_k`, from which `step_weight_bytes` counts what a batch reads."""
    total = embed = 0
    for name, t in model.named_parameters():
        size = t.numel() * t.element_size()
        total += size
        if "embed_tokens" in name:
            embed += size
    out = {"total": total, "embedding": embed, "per_step": total - embed}
    # The stacked experts (FusedExperts: every parameter of the module, whatever its quantization made of them).
    stacks = [m for m in model.modules() if hasattr(m, "local_experts") and hasattr(m, "local_ids")]
    routers = [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "experts")]
    if stacks and routers:
        experts = sum(t.numel() * t.element_size() for m in stacks for t in m.parameters(recurse=False))
        out.update(experts=experts, num_experts=routers[0].experts.num_experts, top_k=routers[0].top_k)
    return out


def step_weight_bytes(weights: dict[str, int], batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens reads: every dense parameter, and of the experts those chosen
    at least once, in expectation under uniform routing, `E (1 - (1 - k / E)^batch)` of the E experts (random
    router weights route about uniformly; a trained router's hot experts read fewer)."""
    if "experts" not in weights:
        return float(weights["per_step"])
    chosen_fraction = 1.0 - (1.0 - weights["top_k"] / weights["num_experts"]) ** batch
    return weights["per_step"] - weights["experts"] * (1.0 - chosen_fraction)


def kv_bytes_per_token(runner: Any) -> int:
    if not isinstance(runner, ModelRunner):
        return runner.kv_bytes_per_token
    return runner.kv_spec.bytes_per_token


def linear_params(hf_config: dict[str, Any]) -> int:
    """Parameters a token multiplies through (every projection and the LM head, not the embedding)."""
    return sum(math_prod(s) for n, s in checkpoint_shapes(hf_config).items()
               if n.endswith("proj.weight") or n == "lm_head.weight")


def math_prod(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def attention_flops(hf_config: dict[str, Any], query_len: int, context_len: int) -> float:
    """QK^T and PV of causal attention for `query_len` new tokens at the end of `context_len` tokens."""
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    pairs = query_len * context_len - query_len * (query_len - 1) / 2
    return 4.0 * pairs * heads * head_dim * hf_config["num_hidden_layers"]


# ------------------------------------------------------------------------------------------------ ceilings


def measure_ceilings(device: torch.device) -> dict[str, Any]:
    """Copy bandwidth and BF16 GEMM rate measured in this run (fallbacks from BENCHMARKS.md on the CPU);
    the 8-bit peak is scaled from the BF16 one by the anchors' ratio (FP8 1315 / BF16 760 TFLOP/s)."""
    ceilings = attn_bench.measure_ceilings(device)
    ceilings["eight_bit_TFLOPs"] = ceilings["bf16_TFLOPs"] * 1315.0 / 760.0
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ceilings


def environment(device: torch.device) -> dict[str, Any]:
    env = attn_bench.environment()
    if device.type != "cuda":
        env["gpu"] = "cpu"
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


# ------------------------------------------------------------------------------------------------ HF peer


def run_hf_peer(task: dict[str, Any], timeout_s: float, in_process: bool = False) -> dict[str, Any]:
    """Run `kestrel.bench.hf_peer` on `task` in a child process (in this one for CPU smoke runs, where
    memory does not matter and a child's imports would dominate); its JSON result, or the error."""
    started = time.perf_counter()
    if in_process:
        from kestrel.bench import hf_peer

        result = hf_peer.latency(task) if task["kind"] == "latency" else hf_peer.throughput(task)
        return {**result, "wall_s": round(time.perf_counter() - started, 2), "in_process": True}
    try:
        proc = subprocess.run([sys.executable, "-m", "kestrel.bench.hf_peer", json.dumps(task)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    result = json.loads(lines[-1])
    result["wall_s"] = round(time.perf_counter() - started, 2)
    return result


def load_hf_result(path: Path, suite: str, output_len: int, input_len: int | None = None) -> dict[str, Any]:
    """The HF peer block of an earlier result file of the same suite and workload (the peer is BF16 either way,
    so one run serves the FP8 runs too)."""
    result = json.loads(Path(path).read_text())
    hf = result.get("hf_peer") or {}
    cfg = result.get("config", {})
    same = cfg.get("output_len") == output_len and (input_len is None or cfg.get("input_len") == input_len)
    if result.get("suite") != suite or not hf or "error" in hf or not same:
        raise ConfigError(f"invalid --hf-result={str(path)!r}: expected a {suite} result with an HF peer for "
                          f"output_len={output_len}" + (f", input_len={input_len}" if input_len else ""))
    return {**hf, "from_file": str(path)}


# ------------------------------------------------------------------------------------------------ output


def write_result(result: dict[str, Any], path: Path | None, quiet: bool = False) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if not quiet:
        print(f"wrote {path}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_device(args: argparse.Namespace, suite: str) -> torch.device:
    """The GPU an end-to-end suite measures on; without one, the CPU only for a model given with --model (--arch's
    random weights are a GPU-sized model: an 8B one would take minutes and tens of GB to build here)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if args.model is None:
        raise ConfigError(f"kestrel bench {suite} measures --arch {args.arch} on a GPU, and there is no CUDA device "
                          f"here: give a model directory with --model to measure it on the CPU, or --smoke to check "
                          f"the script on a tiny model")
    return torch.device("cpu")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model and precision flags of the end-to-end suites (latency, throughput)."""
    p.add_argument("--model", default=None, help="HF model directory (default: --arch with random weights)")
    p.add_argument("--arch", default="llama3-8b", choices=sorted(ARCHS))
    p.add_argument("--weights-dir", type=Path, default=None,
                   help="where the random checkpoint shared with the HF peer is written (reused if present; "
                        "default /tmp/kestrel-bench-ARCH; with --smoke, a temporary directory)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, choices=["fp8", "int8"])
    p.add_argument("--weight-only", default=None, choices=[*sorted(WEIGHT_ONLY_BITS), *GGUF_MIXES],
                   help="random weights of --arch in a compressed-tensors weight-only checkpoint (W4A16 / W8A16 "
                        "kernel), or a GGUF file of llama.cpp's type mix (gguf-*), written to --weights-dir")
    p.add_argument("--group-size", type=int, default=None,
                   help=f"the w4a16 / w8a16 checkpoint's group (-1: channel; default {WEIGHT_ONLY_GROUP})")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the previous one's tokens reach the host (default: on for a GPU)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--max-prefill-graph-tokens", type=int, default=None,
                   help="the engine's max_prefill_graph_tokens: CUDA graphs for prefill and mixed steps of up to "
                        "this many tokens (0: off, prefills run eagerly; default: the engine's, 512 where it "
                        "captures CUDA graphs)")
    p.add_argument("--graph-capture", default=None, choices=GRAPH_CAPTURE_CHOICES,
                   help="the engine's graph_capture: its CUDA graphs captured once it serves (serving) or before "
                        "(startup); default: the engine's, serving (startup behind an executor or with a prompt "
                        "compressor). Either way the timed steps run after every graph is captured")
    p.add_argument("--sparse-decode", type=json.loads, default=None,
                   help="the engine's sparse_decode as JSON, e.g. '{\"method\": \"quest\", \"token_budget\": 2048}'")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--compile-workers", type=int, default=None,
                   help="the engine's compile_workers: processes compiling Triton kernels ahead of the memory profile "
                        "and the graph capture (0: off; default: the engine's, the usable cores less one, at most 8)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="run the model in worker processes (with tp 1: the executor path, for its overhead)")


def refuse_weight_only(args: argparse.Namespace, suite: str) -> None:
    """A ConfigError for `--weight-only` / `--group-size` in a suite that builds its model without them."""
    given = [flag for flag, value in (("--weight-only", args.weight_only), ("--group-size", args.group_size))
             if value is not None]
    if given:
        raise ConfigError(f"invalid {', '.join(given)} for kestrel bench {suite}: its model is --arch's float "
                          "checkpoint (or --model); the weight-only checkpoints are for latency and throughput")


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    """Where an end-to-end suite writes its result, and its CPU smoke mode."""
    p.add_argument("--result-file", type=Path, default=None, help="write the JSON here (and the PNG beside it)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script only")


def build_suite_engine(args: argparse.Namespace, model_dir: str, load_format: str, device: torch.device,
                       max_num_seqs: int, max_model_len: int, capture_graphs_now: bool = True,
                       **extra: Any) -> Engine:
    """The engine of an end-to-end suite from its `add_model_arguments` flags (prefix caching off: prompts
    are distinct anyway, and a hit would skip the work being measured); `extra`: the suite's own engine arguments."""
    return build_engine(
        model_dir, capture_graphs_now, dtype=args.dtype, device=device.type, load_format=load_format,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager, enable_prefix_caching=False,
        max_prefill_graph_tokens=args.max_prefill_graph_tokens, graph_capture=args.graph_capture,
        async_scheduling=args.async_scheduling, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_num_seqs), max_model_len=max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend, sparse_decode=args.sparse_decode,
        compile_workers=args.compile_workers, **extra)


def precision(args: argparse.Namespace, model_dir: str | None = None) -> str:
    """fp8 / int8 when the flag quantizes at load or the checkpoint in `model_dir` is quantized, else the dtype."""
    if args.quantization:
        return args.quantization
    saved = checkpoint_precision(model_dir) if model_dir else None
    return saved or ("bf16" if args.dtype == "bfloat16" else args.dtype)


def checkpoint_precision(model_dir: str) -> str | None:
    """The precision a quantized checkpoint's quantization_config names ("fp8", "int8", "w4a16", ...; "gguf" for a
    GGUF file), None for a float one."""
    if is_gguf_model(model_dir):
        return "gguf"
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    from kestrel.quant.checkpoint import parse_quantization_config

    saved = json.loads(config_file.read_text()).get("quantization_config")
    return parse_quantization_config(saved).precision if saved else None


def engine_config_block(args: argparse.Namespace, engine: Engine, model_dir: str, load_format: str) -> dict[str, Any]:
    """The model, precision and engine settings a result was measured with (the suite adds its workload)."""
    return {"model": model_dir, "arch": None if args.model or args.smoke else args.arch,
            "load_format": load_format, "dtype": args.dtype, "quantization": args.quantization,
            "weight_only": args.weight_only,
            "group_size": ((WEIGHT_ONLY_GROUP if args.group_size is None else args.group_size)
                           if args.weight_only in WEIGHT_ONLY_BITS else None),
            "precision": precision(args, model_dir), "kv_cache_dtype": args.kv_cache_dtype,
            "enforce_eager": args.enforce_eager, "max_prefill_graph_tokens": args.max_prefill_graph_tokens,
            "graph_capture": getattr(engine.runner, "graph_capture", None),
            "sparse_decode": args.sparse_decode,
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size,
            "distributed_executor_backend": args.distributed_executor_backend,
            "async_scheduling": engine.core.async_scheduling,
            "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
            "kv_cache_blocks": engine.runner.num_blocks, "smoke": args.smoke}


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend, or None where matplotlib is not installed (the
    suites then write their JSON alone)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> bool:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def target_lines(targets: list[dict[str, Any]], fmt: str = ".1f") -> list[str]:
    """One PASS / FAIL line per target: what, measured, limit."""
    lines = []
    for t in targets:
        measured = "-" if t["measured"] is None else format(t["measured"], fmt)
        lines.append(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {measured} (limit {format(t['limit'], fmt)})")
    return lines


def report(result: dict[str, Any], summary_text: str, path: Path | None,
           plot: Callable[[dict[str, Any], Path], bool]) -> None:
    """Print the summary, write the JSON and, beside it, the PNG."""
    print(summary_text)
    write_result(result, path)
    if path is not None and plot(result, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
