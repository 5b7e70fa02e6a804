"""The one engine constructor: LLM, AsyncLLM and the server build their engine here from an EngineConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kestrel.config import ConfigError, EngineConfig
from kestrel.engine.core import EngineCore
from kestrel.entrypoints.media import MediaProcessor, media_processor
from kestrel.executor.base import Executor
from kestrel.executor.factory import build_executor
from kestrel.loader.gguf_config import model_hf_config
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.model.registry import get_model_class
from kestrel.structured.shards import engine_grammar_backend, start_grammar_workers_early
from kestrel.worker.model_runner import ModelRunner
from kestrel.worker.runner_setup import compile_pool_started_early, runs_on_cpu


@dataclass
class BuiltEngine:
    tokenizer: Any
    runner: ModelRunner | Executor
    core: EngineCore
    media: MediaProcessor | None = None  # a multimodal model's processor; None: text only


# A CPU text engine's token budget per step when none is given: prefill chunks of 512 rows keep the MLP's [rows, 2 x
# intermediate] activations near the caches, where the 2048 of a GPU stream them through memory (the 0.5B-class
# model's offline run: 41.3 s against 45.2 s, docs/benchmarks.md "CPU backend"); the GEMMs lose nothing at 512 rows.
CPU_MAX_NUM_BATCHED_TOKENS = 512


def engine_config(model: str, **engine_args: Any) -> EngineConfig:
    """The EngineConfig of `LLM(model, **engine_args)`: a GGUF model's config comes from its metadata; a CPU engine
    of a text model with chunked prefill and no `max_num_batched_tokens` given gets CPU_MAX_NUM_BATCHED_TOKENS (at
    least max_num_seqs; a multimodal model keeps the larger budget its images' placeholder runs may need)."""
    config = EngineConfig.from_kwargs(model, hf_config=model_hf_config(model), **engine_args)
    scheduler = config.scheduler
    if ("max_num_batched_tokens" in engine_args or not scheduler.enable_chunked_prefill
            or scheduler.max_num_batched_tokens <= CPU_MAX_NUM_BATCHED_TOKENS
            or not runs_on_cpu(config.device) or model_modalities(config)):
        return config
    budget = max(CPU_MAX_NUM_BATCHED_TOKENS, scheduler.max_num_seqs)
    return config.replace(scheduler=dataclasses.replace(scheduler, max_num_batched_tokens=budget))


def build_engine(config: EngineConfig) -> BuiltEngine:
    """Tokenizer, model runner (weights, KV cache, graphs) and the engine core with its grammar backend. With
    tensor/pipeline parallelism (or a named executor backend) the runner is an executor over worker processes
    and this process holds no model."""
    with compile_pool_started_early(config):
        tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.trust_remote_code)
        built = build_engine_core(config, tokenizer, tokenizer.eos_token_id)
    built.media = media_processor(config.model, model_modalities(config), tokenizer)
    return built


def model_modalities(config: EngineConfig) -> frozenset[str]:
    """The media the configured architecture takes (its class's declaration; empty for a text-only model)."""
    architecture = (config.model.hf_config.get("architectures") or [""])[0]
    try:
        return frozenset(getattr(get_model_class(architecture), "supported_modalities", ()))
    except ConfigError:
        return frozenset()  # the loader names the unknown architecture


def core_process_by_default(config: EngineConfig) -> bool:
    """Whether `kestrel serve` runs the engine core in its own process when not told either way: for a text model
    on the CPU without worker processes, where the split served faster (the engine loop and the HTTP thread no
    longer share one interpreter; docs/benchmarks.md, "CPU backend"). A GPU keeps the core in the server's
    process until served runs there have measured the split."""
    return runs_on_cpu(config.device) and not model_modalities(config) and not config.parallel.uses_workers


def build_engine_core(config: EngineConfig, tokenizer: Any, eos_token_id: int | None,
                      deltas: bool = False) -> BuiltEngine:
    """`build_engine` with the tokenizer given. None: its outputs carry token ids only, and its grammar backend
    gets the vocabulary from its client (GrammarBackend.use_tokenizer_info). `deltas`: an engine core in its own
    process, whose client tokenizes, detokenizes and builds the outputs from each step's SequenceDeltas."""
    runner: ModelRunner | Executor
    if model_modalities(config) and (config.parallel.uses_workers or tokenizer is None):
        raise ConfigError("a multimodal model's images reach its runner in this process: run it without "
                          "tensor/pipeline parallelism, distributed_executor_backend or --engine-core-process")
    start_grammar_workers_early(config, on_cuda=not runs_on_cpu(config.device))
    if config.parallel.uses_workers:
        runner = build_executor(config, eos_token_id)
    else:
        runner = ModelRunner(config, eos_token_id=eos_token_id)
    structured = engine_grammar_backend(config, runner, tokenizer)
    core = EngineCore(config, runner, runner.kv_layout, tokenizer, eos_token_id, structured,
                      detokenize=tokenizer is not None, deltas=deltas)
    return BuiltEngine(tokenizer, runner, core)
