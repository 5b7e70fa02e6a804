"""A model runner's setup: the device and dtype, the model (and a worker-side drafter), the memory plan (a profiling
forward sizes the KV cache), the KV cache allocated and bound to the attention layers, the decode and verify CUDA
graphs (with max_prefill_graph_tokens, the prefill / mixed-step graphs too), FP8 KV-scale calibration and the debug
launch count.

Every forward of the target model (profiling, calibration, capture, a step) goes through `RunnerSetup._run_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kestrel import ops
from kestrel.config import DEFAULT_PREFILL_GRAPH_TOKENS, ConfigError, EngineConfig
from kestrel.distributed.parallel import ParallelContext
from kestrel.fork_server import main_module_hidden
from kestrel.kv_spec import KVCacheLayout, SinkWindowSpec
from kestrel.loader import load_model
from kestrel.loader.hf_config import resolve_dtype
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.expert_load import ExpertLoad
from kestrel.worker.cpu_runtime import configure_cpu_process
from kestrel.worker.cuda_graph import GraphRunner, verify_batch_limit
from kestrel.worker.drafter import build_drafter
from kestrel.worker.dry_layers import one_layer_of_each_kind
from kestrel.worker.kv_cache import (
    FP8_E4M3_MAX,
    CachingLayer,
    KVCacheShape,
    allocate_kv_cache,
    bind_key_bounds,
    bind_layer_caches,
    bind_streaming_window,
    gpu_kv_cache_budget,
    key_bounds_bytes_per_block,
    kv_cache_dtype,
    kv_cache_groups,
    kv_cache_scales,
    num_blocks_for,
)
from kestrel.worker.launch_count import decoder_layer_launches
from kestrel.worker.media_encoder import MediaEncoder
from kestrel.worker.mrope import uses_mrope
from kestrel.worker.prefill_graph import PrefillBuckets
from kestrel.worker.stage_transport import run_model

logger = logging.getLogger(__name__)


def host_threads_for_gpu_steps() -> None:
    """On a GPU the host's tensors are small (ids, block tables, grammar bitmasks): run torch's CPU ops on one
    thread. With a pool, each op large enough to go parallel left its threads spinning, and they took the cores
    the engine loop and the grammar matchers need (H200 host, batch 64 constrained by a JSON schema: +51% per
    step with 16 threads, +8% with one). Called once the model and KV cache are built, so loading keeps them."""
    if torch.get_num_threads() != 1:
        logger.info("torch CPU threads %d -> 1: the host side of GPU steps is small, and idle pool threads spin",
                    torch.get_num_threads())
        torch.set_num_threads(1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("invalid device='cuda': no CUDA device is available here; use device='cpu' or 'auto'")
    return torch.device(name)


def runs_on_cpu(device: str) -> bool:
    """Where `device` resolves to the CPU ("cuda" never does; without CUDA it is refused when the runner starts)."""
    return device != "cuda" and resolve_device(device).type == "cpu"


def compile_worker_count(config: EngineConfig, on_cuda: bool, single_process: bool) -> int:
    """Processes compiling Triton kernels ahead of the profile and the capture: `compile_workers`, or where unset
    the usable cores less one (at most 8) for a runner on a CUDA device that may capture graphs and holds the whole
    model (`single_process`), else 0."""
    if config.compile_workers is not None:
        return config.compile_workers
    return ops.default_workers() if on_cuda and not config.enforce_eager and single_process else 0


@contextlib.contextmanager
def compile_pool_started_early(config: EngineConfig) -> Iterator[None]:
    """Around an engine's build: start the compile workers of the runner that `config` builds in this process
    (none where its model runs in worker processes or on the CPU) before the tokenizer and the runner load, since
    their imports take seconds; the runner takes them. A build that ends without its runner taking them (refused)
    ends them."""
    if not config.parallel.uses_workers and not runs_on_cpu(config.device) and torch.cuda.is_available():
        with main_module_hidden():
            ops.start_pool_early(compile_worker_count(config, on_cuda=True, single_process=True))
    try:
        yield
    finally:
        ops.discard_early_pool()


class RunnerSetup:
    """The loaded model on its device with its KV cache, scales and graphs (the state a model runner steps on)."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None = None,
                 parallel: ParallelContext | None = None) -> None:
        """`parallel`: this rank's place in a tensor/pipeline-parallel group (kestrel.executor.worker);
        None runs the whole model in this process."""
        self.config = config
        self.parallel = parallel
        self.device = resolve_device(config.device)
        if self.device.type != "cpu" and config.cpu_threads is not None:
            raise ConfigError(f"invalid cpu_threads={config.cpu_threads}: the engine runs on {self.device.type}; "
                              "leave it unset")
        if self.device.type == "cpu":  # ranks of an executor get their share of the cores from it
            configure_cpu_process(config.cpu_threads, parallel is None or config.cpu_threads is not None)
        model_config = config.model
        if self.device.type == "cpu" and model_config.dtype == "auto":
            # Half-precision matmuls are many times slower than float32 on most CPUs.
            model_config = dataclasses.replace(model_config, dtype="float32")
        self.dtype = resolve_dtype(model_config.dtype, model_config.hf_config)
        self.eos_token_id = eos_token_id
        # min_tokens holds back every EOS id: the tokenizer's and generation_config.json's.
        own = frozenset() if eos_token_id is None else frozenset({eos_token_id})
        self.eos_token_ids = own | config.model.generation_defaults.eos_token_ids
        torch.manual_seed(config.model.seed)
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = -(-(config.model.max_model_len or 1) // self.block_size)
        # Attention sinks + window: each request keeps its sink blocks; the blocks after them leave with the window.
        self.streaming_sink_blocks = config.streaming.sink_blocks(self.block_size) if config.streaming else None
        # Seconds of each start-up phase, in order (the benches record them beside their start-up to first token).
        self.startup_seconds: dict[str, float] = {}
        lap = time.perf_counter()
        # Triton compiles ahead of the profile and the graph capture run in these processes, started now so that
        # their imports overlap the weights' loading (kestrel.kernels.compile_ahead).
        with main_module_hidden():  # the workers run kestrel's functions only, not the program's script
            self._compile_pool = ops.start_pool(self._compile_workers())
        try:
            self.compile_ahead_stats: list[dict[str, Any]] = []
            self.model = load_model(model_config, config.quant, self.device, parallel, self._planned_kv_cache_bytes)
            lap = self._lap("weights", lap)
            self.vocab_size: int = int(config.model.hf_config["vocab_size"])
            # A multimodal model's media reach its first pipeline stage's input embeddings through the encoder step.
            self.supported_modalities: frozenset[str] = frozenset(getattr(self.model, "supported_modalities", ()))
            self.media_encoder = (MediaEncoder(self.model, config.cache.encoder_cache_size)
                                  if self.supported_modalities else None)
            # M-RoPE models take [3, T] positions (`kestrel.worker.mrope`), which the captured graphs and the drafters'
            # one-row positions do not carry: such a model runs eagerly and without speculative decoding.
            self.mrope = uses_mrope(self.model)
            # Images that attend to themselves both ways (Gemma 3): the engine marks their items, the scheduler keeps
            # each run in one step and the step's rows get their causal ends (`kestrel.worker.media_attention`).
            self.bidirectional_media = bool(getattr(self.model, "bidirectional_media", False))
            # Encoder-decoder models (Whisper): the encoder step writes each request's cross-attention K/V once; they
            # run eagerly (the cross-attention reads are not captured) and without speculative decoding.
            self.encoder_decoder = bool(getattr(self.model, "is_encoder_decoder", False))
            if self.encoder_decoder and config.speculative is not None:
                raise ConfigError("invalid speculative_config: this model is an encoder-decoder (Whisper), which "
                                  "kestrel's drafters do not serve")
            if self.encoder_decoder and config.debug_launch_count:
                raise ConfigError("invalid debug_launch_count=True: the launch count runs a decoder-only layer alone, "
                                  "and an encoder-decoder (Whisper) layer also reads the encoder's cross-attention "
                                  "K/V; leave it off")
            if self.mrope and config.speculative is not None:
                raise ConfigError("invalid speculative_config: this model rotates by M-RoPE (three position rows), "
                                  "which kestrel's drafters do not carry")
            # Bound before any forward, so the captured graphs count too.
            self.expert_counts = ExpertLoad.attach(self.model) if config.expert_load_metrics else None
            layers = self.model.attention_layers()
            bind_streaming_window(layers, config.streaming)
            if config.streaming is not None:
                streaming = config.streaming
                streamed = SinkWindowSpec(1, 1, window=streaming.window, sink_tokens=streaming.sink_tokens)
                self.max_blocks_per_seq = max(self.max_blocks_per_seq, streamed.max_blocks_per_request(self.block_size))
                if self.device.type == "cuda" and not config.enforce_eager:
                    raise ConfigError("invalid enforce_eager=False with streaming_window: the sink + window attention "
                                      "reads each step's lengths on the host and cannot run in CUDA graphs; set "
                                      "enforce_eager=True (--enforce-eager)")
            self.kv_spec = KVCacheShape.of_layers(layers, kv_cache_dtype(config.cache, self.dtype), self.block_size)
            # A cross-attention group's block list holds the encoder's positions, which may outnumber the decoder's.
            self.max_blocks_per_seq = max(self.max_blocks_per_seq, self.kv_spec.blocks_per_request(0))
            # The groups are every stage's; `layer_groups[i]` is the group of this stage's attention layer i.
            self.kv_groups, self.layer_groups = kv_cache_groups(self.kv_spec.layer_specs, parallel)
            self.graph_runner: GraphRunner | None = None
            self.graph_capture = self._resolve_graph_capture()
            # A draft model or EAGLE head: loaded before the memory profile, its K/V in the target's blocks.
            self.drafter = build_drafter(config, self.model, self.dtype, self.kv_spec.dtype, self.device)
            draft_bytes = self.drafter.kv_spec.bytes_per_block if self.drafter is not None else 0
            bounds_bytes = key_bounds_bytes_per_block(layers, config.sparse, self.block_size, self.kv_spec.dtype)
            lap = self._lap("model_setup", lap)
            self.prefill_graph_tokens = self._resolve_prefill_graph_tokens()
            budget = self._profiled_kv_budget()
            self.num_blocks = num_blocks_for(config, self.kv_spec, budget, draft_bytes + bounds_bytes)
            lap = self._lap("memory_profile", lap)
            if parallel is not None:  # every rank holds the same blocks: as many as the tightest rank can
                self.num_blocks = parallel.min_over_world(self.num_blocks, self.device)
            # A drafter's K/V lives in group 0's blocks and its layers may read past that group's window.
            self.kv_layout = KVCacheLayout(self.block_size, self.kv_groups, (self.num_blocks,) * len(self.kv_groups),
                                           keep_all_blocks=frozenset({0} if self.drafter is not None else ()))
            self.kv_caches = allocate_kv_cache(self.kv_spec, self.num_blocks, self.device)
            if self.drafter is not None:
                self.drafter.bind(self.num_blocks)
            self.bind_kv_caches(kv_cache_scales(config, layers))
            # Quest's key bounds, bound before the graphs are captured (they are kernel arguments there).
            self.key_bounds = bind_key_bounds(layers, config.sparse, self.num_blocks, self.device)
            lap = self._lap("kv_cache", lap)
            graphs = self._new_graph_runner() if self._captures_graphs() else None
            # The calibration's kernels and every graph's compile ahead side by side, in one wait for the pool.
            calibration = self._calibration_forward() if config.cache.calculate_kv_scales else None
            with torch.inference_mode():
                self._compile_ahead([*([calibration] if calibration else []),
                                     *(graphs.capture_forwards() if graphs is not None else [])])
            lap = self._lap("compile_ahead", lap)
            if config.cache.calculate_kv_scales:  # before the capture, whose graphs take the scales as arguments
                self.calibrate_kv_scales()
                lap = self._lap("kv_scales", lap)
            self.launches_per_layer: int | None = None
            if config.debug_launch_count:
                self.launches_per_layer = self._count_layer_launches()
            if graphs is not None:
                self._capture_graphs(graphs)
                if self.drafter is not None:
                    self.drafter.capture_graphs(config.scheduler.max_num_seqs, self.max_blocks_per_seq,
                                                *self._verify_shapes())
            if self.prefill_graph_tokens and self.graph_runner is None:
                raise ConfigError(f"invalid max_prefill_graph_tokens={self.prefill_graph_tokens}: this model runs "
                                  "every step eagerly (no CUDA graphs are captured for it); leave it 0")
        except BaseException:
            self._stop_compile_pool(terminate=True)  # a refused runner leaves no compile workers behind
            raise
        self._stop_compile_pool()
        self._lap("graphs", lap)
        if self.expert_counts is not None:
            self.expert_counts.reset()

    def _lap(self, phase: str, since: float) -> float:
        """Record the seconds since `since` as start-up phase `phase`; returns now."""
        now = time.perf_counter()
        self.startup_seconds[phase] = now - since
        return now

    def _compile_workers(self) -> int:
        workers = self.config.compile_workers
        if workers and self.device.type != "cuda":
            raise ConfigError(f"invalid compile_workers={workers}: it compiles a GPU's Triton kernels and this "
                              f"engine runs on {self.device.type}; leave it unset or 0")
        single = self.parallel is None or self.parallel.world_size == 1
        return compile_worker_count(self.config, self.device.type == "cuda", single)

    def _compile_ahead(self, forwards: list[Callable[[], object]],
                       prefetch: Callable[[], list[Callable[[], object]]] | None = None) -> None:
        """Run `forwards` dry, one decoder layer of each kind (`dry_layers`), and compile the Triton kernels they
        would launch on the compile pool (a no-op without one). A forward that fails dry is logged and left: its
        kernels compile when they launch. `prefetch`: builds a later wave's forwards, whose kernels then compile
        behind these without this wave waiting for them (`ops.compile_ahead`)."""
        if self._compile_pool is None:
            return
        later: list[Callable[[], object]] = []
        try:
            later = prefetch() if prefetch else []
        except Exception as e:  # those kernels compile in their own wave
            logger.info("no prefetch of a later wave's kernels (%s)", str(e))
        try:
            with one_layer_of_each_kind(self.model) as left_out:
                stats = ops.compile_ahead(self._compile_pool, forwards, later)
            self.compile_ahead_stats.append({**stats, "layers_left_out": float(left_out)})
        except Exception as e:  # nothing ran for real; the real forward raises what is wrong, if anything
            logger.warning("compiling ahead stopped: %s; the rest compiles as it launches", str(e))
        torch.cuda.synchronize(self.device)

    def _stop_compile_pool(self, terminate: bool = False) -> None:
        if self._compile_pool is not None:
            ops.stop_pool(self._compile_pool, terminate)
            self._compile_pool = None

    def _planned_kv_cache_bytes(self, layers: Sequence[CachingLayer]) -> int:
        """The KV cache this runner allocates after the weights, for the loader's memory plan (`layers`: the
        model's attention layers, on the meta device): as `num_blocks_for` sizes it, with one max_model_len
        sequence in place of the GPU's profiled budget (the least that serves a full-length request)."""
        shape = KVCacheShape.of_layers(layers, kv_cache_dtype(self.config.cache, self.dtype), self.block_size)
        if shape.bytes_per_block < 1:
            return 0
        per_block = shape.bytes_per_block + key_bounds_bytes_per_block(layers, self.config.sparse, self.block_size,
                                                                       shape.dtype)
        one_sequence = self.max_blocks_per_seq * per_block if self.device.type == "cuda" else None
        return num_blocks_for(self.config, shape, one_sequence, per_block - shape.bytes_per_block) * per_block

    @property
    def is_last_stage(self) -> bool:
        """Whether this runner holds the LM head and samples (always, without pipeline parallelism)."""
        return self.parallel is None or self.parallel.is_last_stage

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                   transport: bool = True, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The target model's forward: the one place every forward of it goes through. Pipeline stages receive
        and send their intermediate tensors here (`transport=False`: a later stage runs on zeros instead)."""
        return run_model(self.model, self.parallel, input_ids, positions, attn_metadata, transport=transport,
                         inputs_embeds=inputs_embeds)

    # ----- KV cache scales (FP8 cache) -----------------------------------------------------------------

    def bind_kv_caches(self, scales: list[tuple[float, float]], recapture: bool = True) -> None:
        """Bind each layer's cache with its (k_scale, v_scale) and its KV-cache group; the captured graphs, which
        take the scales as kernel arguments, are captured again unless `recapture` is False (they then replay
        the scales bound before until the next capture)."""
        self.kv_scales = list(scales)
        bind_layer_caches(self.model.attention_layers(), self.kv_caches, self.kv_scales, self.layer_groups)
        if recapture and self.graph_runner is not None:
            self._capture_graphs()

    @torch.inference_mode()
    def calibrate_kv_scales(self, token_ids: list[int] | None = None, num_tokens: int = 512,
                            passes: int = 2) -> list[tuple[float, float]]:
        """FP8 KV scales from a calibration prefill (random token ids unless given): per layer,
        scale = max |K| (resp. |V|) / 448, then rebind. The first pass runs with the current scales, whose
        saturation perturbs later layers; the next pass repeats with the measured ones. Call before serving:
        it writes the first blocks of the cache."""
        if self.kv_spec.dtype != torch.float8_e4m3fn:
            return self.kv_scales
        ids, positions, meta = self._calibration_inputs(token_ids, num_tokens)
        layers = self.model.attention_layers()
        seen = torch.zeros(len(layers), 2, device=self.device)  # running max |K|, |V| per layer

        def hook(i: int):
            def record(_module, args) -> None:
                seen[i, 0] = torch.maximum(seen[i, 0], args[1].abs().max().float())
                seen[i, 1] = torch.maximum(seen[i, 1], args[2].abs().max().float())
            return record

        for done in range(1, passes + 1):
            handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
            try:
                self._run_model(ids, positions, meta)
            finally:
                for h in handles:
                    h.remove()
            amax = seen.clamp_min(1e-6).tolist()
            # The passes run eagerly: graphs captured already are captured again once, with the last scales.
            self.bind_kv_caches([(k / FP8_E4M3_MAX, v / FP8_E4M3_MAX) for k, v in amax], recapture=done == passes)
        if self.expert_counts is not None:
            self.expert_counts.reset()
        return self.kv_scales

    def _calibration_inputs(self, token_ids: list[int] | None = None, num_tokens: int = 512
                            ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The calibration prefill: `token_ids` (random ids unless given) in one sequence from the cache's first
        block, as long as the cache, max_model_len and a streaming engine's kept tokens allow."""
        if token_ids is None:
            g = torch.Generator().manual_seed(self.config.model.seed)
            token_ids = torch.randint(0, self.vocab_size, (num_tokens,), generator=g).tolist()
        n = min(len(token_ids), self.num_blocks * self.block_size, self.config.model.max_model_len or len(token_ids))
        if self.config.streaming is not None:  # no longer than the prompts such an engine takes
            n = min(n, self.config.streaming.num_kept_tokens)
        ids = torch.tensor(token_ids[:n], dtype=torch.long, device=self.device)
        num_blocks = -(-n // self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device).unsqueeze(0),
            max_query_len=n, max_seq_len=n,
        ).sharing_group_tables(len(self.kv_groups))
        return ids, torch.arange(n, device=self.device), meta

    def _calibration_forward(self) -> Callable[[], object] | None:
        """The start-up calibration's forward (calculate_kv_scales), for compiling its kernels ahead; None where
        the cache is not FP8 (nothing is calibrated)."""
        if self.kv_spec.dtype != torch.float8_e4m3fn:
            return None
        ids, positions, meta = self._calibration_inputs()
        return lambda: self._run_model(ids, positions, meta)

    # ----- GPU memory profiling and CUDA graphs --------------------------------------------------------

    def _profiled_kv_budget(self) -> int | None:
        """On CUDA, the KV budget from a profiling forward pass; None elsewhere or when no profile is needed."""
        cache = self.config.cache
        if self.device.type != "cuda" or cache.num_blocks is not None or cache.kv_cache_memory_bytes is not None:
            return None
        peak = self._profile_peak_memory()
        total = torch.cuda.mem_get_info(self.device)[1]
        budget = gpu_kv_cache_budget(total, peak, cache.gpu_memory_utilization)
        logger.info("memory profile: peak %.2f GiB of %.2f GiB; KV cache budget %.2f GiB at "
                    "gpu_memory_utilization=%.2f", peak / 2**30, total / 2**30, max(budget, 0) / 2**30,
                    cache.gpu_memory_utilization)
        return budget

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Peak bytes of a forward pass over `max_num_batched_tokens` tokens (one prefill sequence) plus the
        logits of `max_num_seqs` rows, with a one-block KV cache that the pass never writes (slot -1)."""
        num_tokens = self.config.scheduler.max_num_batched_tokens
        num_rows = min(num_tokens, self.config.scheduler.max_num_seqs)
        spec = self.kv_spec
        scratch = allocate_kv_cache(spec, 1, self.device)
        bind_layer_caches(self.model.attention_layers(), scratch, None, self.layer_groups)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(1, -(-num_tokens // spec.block_size), dtype=torch.int32, device=self.device),
            max_query_len=num_tokens, max_seq_len=num_tokens,
        ).sharing_group_tables(len(self.kv_groups))
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % max(self.config.model.max_model_len or 1, 1)
        # Quest's key bounds are bound after the profile: without them its decode would prefetch dense kernels.
        prefetch = self._captures_graphs() and self.config.sparse is None
        self._compile_ahead([lambda: self._run_model(ids, positions, meta, transport=False)],
                            prefetch=self._graph_forwards if prefetch else None)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = self._run_model(ids, positions, meta, transport=False)
        if self.is_last_stage:  # only the last pipeline stage has an LM head
            torch.softmax(self.model.compute_logits(hidden[-num_rows:]), dim=-1)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory outside PyTorch's allocator (CUDA context, cuBLAS workspaces) counts against the budget too.
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) + max(non_torch, 0)
        del hidden, scratch
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    def _count_layer_launches(self) -> int:
        layer = self.model.decoder_layers()[0]
        count = decoder_layer_launches(layer, self.model.hidden_size, self.dtype, self.device)
        kind = "CUDA kernels" if self.device.type == "cuda" else "ATen compute ops (CPU proxy for launches)"
        logger.info("decode step of one decoder layer: %d %s", count, kind)
        return count

    def _verify_shapes(self) -> tuple[list[int], int]:
        """The query lengths and largest batch of the verify-step graphs (the target's and a drafter's catch-up):
        a row scores its last token and up to k drafts, q = 2 .. k + 1 tokens."""
        spec = self.config.speculative
        max_num_seqs = self.config.scheduler.max_num_seqs
        if spec is None:
            return [], verify_batch_limit(max_num_seqs, None)
        return list(range(2, spec.num_speculative_tokens + 2)), verify_batch_limit(max_num_seqs,
                                                                                  spec.disable_by_batch_size)

    def _captures_graphs(self) -> bool:
        """Whether this runner captures CUDA graphs at all: one CUDA device, not enforce_eager, no M-RoPE (its
        [3, T] positions are not carried), not encoder-decoder."""
        return (self.device.type == "cuda" and not self.config.enforce_eager and not self.mrope
                and not self.encoder_decoder and (self.parallel is None or self.parallel.world_size == 1))

    def _resolve_prefill_graph_tokens(self) -> int:
        """The prefill graphs' token limit: DEFAULT_PREFILL_GRAPH_TOKENS where this runner captures CUDA graphs when
        max_prefill_graph_tokens is unset, else 0. An explicit limit asking for graphs this runner would not capture
        is refused by name (the config checked what it could without the device and the model)."""
        limit = self.config.max_prefill_graph_tokens
        if limit is None:
            return DEFAULT_PREFILL_GRAPH_TOKENS if self._captures_graphs() else 0
        if not limit:
            return 0
        if self.device.type != "cuda":
            raise ConfigError(f"invalid max_prefill_graph_tokens={limit}: CUDA graphs need a CUDA device and this "
                              f"engine runs on {self.device.type}; leave it 0")
        if self.mrope:
            raise ConfigError(f"invalid max_prefill_graph_tokens={limit}: this model rotates by M-RoPE (three "
                              "position rows), which the captured graphs do not carry, so it runs eagerly; leave "
                              "it 0")
        if self.parallel is not None and self.parallel.world_size > 1:
            raise ConfigError(f"invalid max_prefill_graph_tokens={limit}: CUDA graphs are captured on one device "
                              "only; leave it 0 with tensor or pipeline parallelism")
        return limit

    def _prefill_buckets(self) -> PrefillBuckets | None:
        scheduler = self.config.scheduler
        return PrefillBuckets.for_engine(self.prefill_graph_tokens, scheduler.max_num_batched_tokens,
                                         scheduler.max_num_seqs)

    def _graph_forwards(self) -> list[Callable[[], object]]:
        """The capture's forwards for the memory profile's compile wave to prefetch (their kernels compile while the
        profile and the KV cache's set-up run), on a graph runner of their own and the profile's one-block cache:
        the kernels' specializations do not depend on the number of blocks. The real capture's wave finds them
        compiled, or waits for the same compiles."""
        return self._new_graph_runner().capture_forwards()

    def _new_graph_runner(self) -> GraphRunner:
        return GraphRunner(self._run_model, self.config.scheduler.max_num_seqs, self.max_blocks_per_seq,
                           self.device, *self._verify_shapes(), num_groups=len(self.kv_groups),
                           prefill=self._prefill_buckets(), block_size=self.block_size)

    def _capture_graphs(self, runner: GraphRunner | None = None) -> None:
        """Capture (or queue, graph_capture="serving") every graph of `runner`, a new one unless given (its
        kernels compiled ahead already)."""
        self.graph_runner = None  # release the previous graphs' pool before capturing new ones
        with torch.inference_mode():
            if runner is None:
                runner = self._new_graph_runner()
                self._compile_ahead(runner.capture_forwards())
            if self.graph_capture == "serving":  # one graph before each step and while idle (`capture_next_graph`)
                runner.begin_capture()
            else:
                runner.capture()
        self.graph_runner = runner

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing the model's CUDA graphs so far."""
        return self.graph_runner.capture_seconds if self.graph_runner is not None else 0.0

    @property
    def graphs_ready_at(self) -> float | None:
        """perf_counter() when the last of the model's CUDA graphs was captured; None while any is pending or none
        is captured."""
        return self.graph_runner.finished_at if self.graph_runner is not None else None

    @property
    def graphs_pending(self) -> bool:
        """Whether CUDA graphs are still to be captured (graph_capture="serving")."""
        return self.graph_runner is not None and self.graph_runner.pending

    @torch.inference_mode()
    def capture_next_graph(self) -> None:
        """Capture the next pending CUDA graph (a no-op when none is); it waits for the steps in flight."""
        if self.graphs_pending:
            self.graph_runner.capture_next()

    def _resolve_graph_capture(self) -> str | None:
        """When this runner captures its CUDA graphs: graph_capture; where unset, "serving" unless the config names
        what needs them captured at start-up (`EngineConfig.serving_capture_blocker`: an executor's ranks, whose
        steps come from the executor without idle turns to capture in, or a prompt compressor), then "startup".
        None where it captures none, and an explicit setting there is refused by name."""
        mode = self.config.graph_capture
        if not self._captures_graphs():
            if mode is not None:
                raise ConfigError(f"invalid graph_capture={mode!r}: this engine captures no CUDA graphs (a CPU "
                                  "device, an M-RoPE or encoder-decoder model, or several ranks); leave it unset")
            return None
        if mode is not None:
            return mode
        return "startup" if self.config.serving_capture_blocker() is not None else "serving"
