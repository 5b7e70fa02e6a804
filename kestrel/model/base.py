"""The model contract, and the decoder-only causal LM that most families are.

What the runner relies on (`CausalLM`): a forward over a flat batch of tokens with explicit attention metadata;
float32 logits of chosen rows; this rank's attention layers (one KV cache each); under pipeline parallelism the
tensors a stage hands the next (the runner moves them: a model never sends or receives); the input embedding
(shared by EAGLE heads); this stage's decoder layers (launch counting); checkpoint loading from its declared
layout (`kestrel.model.loading`).

A family file subclasses `DecoderForCausalLM`, reads its config.json into a `DecoderArch` (`arch_config`) and
names its layer class when it differs from the pre-norm `DecoderLayer`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from kestrel import ops
from kestrel.config import QuantConfig, num_labels
from kestrel.distributed.parallel import ParallelContext, single_process
from kestrel.model import loading
from kestrel.model.arch import DecoderArch
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.attention import Attention
from kestrel.model.layers.decoder import DecoderLayer, make_norm
from kestrel.model.layers.embedding import LMHead, VocabEmbedding
from kestrel.model.layers.linear import process_linear_layers_after_loading
from kestrel.model.layers.rotary import RotaryEmbedding
from kestrel.model.layers.weights import default_weight_loader
from kestrel.quant import QuantPlan, get_quant_method
from kestrel.quant.scheme import KV_SCALE_NAMES

# The quantization a model is built with: the plan, or an online QuantConfig (tests), or none.
Quantization = QuantPlan | QuantConfig | None
# What a pipeline stage before the last hands the next: named tensors of [num_tokens, ...].
IntermediateTensors = dict[str, torch.Tensor]
TensorSpec = tuple[tuple[int, ...], torch.dtype]


class CausalLM(Protocol):
    """The contract between a model and the worker. Nothing outside `kestrel.model` knows more of a model."""

    hidden_size: int
    vocab_size: int

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """`input_ids [T]`, `positions [T]` -> hidden states `[T, hidden]` on the last pipeline stage, else the
        tensors for the next stage; a stage after the first reads the previous one's instead of `input_ids`."""

    def intermediate_specs(self, num_tokens: int) -> dict[str, TensorSpec]:
        """Shape and dtype of each tensor a stage receives from the previous one, in send order."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[R, vocab]` (last pipeline stage only)."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[T]` -> the first layer's input embeddings `[T, hidden]` (scaled as `forward` scales them); `forward`
        takes them, edited, as `inputs_embeds` in place of `input_ids` (first pipeline stage)."""

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Float32 pooled hidden states `[R, hidden]` -> what a pooling request returns: the vectors themselves
        (embeddings), or a classifier's `[R, num_labels]` logits."""

    def attention_layers(self) -> list[Attention]: ...

    # Multimodal models only (`supported_modalities` not empty): each item's `data` (the processor's tensors) ->
    # its embeddings `[item's placeholder count, hidden]` in the model dtype, one encoder pass for the whole list.
    # The runner writes them into `embed_input_ids`'s output at the item's placeholder positions.
    supported_modalities: frozenset[str]

    def embed_multimodal(self, modality: str, items: list[Any]) -> list[torch.Tensor]: ...

    def decoder_layers(self) -> list[nn.Module]: ...

    def get_input_embeddings(self) -> nn.Module | None: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def process_weights_after_loading(self) -> None: ...


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm. Under pipeline parallelism a stage builds only its own layers (the
    others are empty placeholders, so parameter names keep their layer index), the first stage the embedding,
    the last the final norm."""

    def __init__(self, arch: DecoderArch, dtype: torch.dtype, quant_config: Quantization, parallel: ParallelContext,
                 layer_cls: type[nn.Module], packed_modules: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        self.parallel = parallel
        self.hidden_size = arch.hidden_size
        self.dtype = dtype
        self.stage_layers = parallel.stage_layers(arch.num_layers)
        if parallel.is_first_stage:
            self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype, parallel)
        # Rounded to the model dtype once, as the reference implementations multiply by it.
        self.embedding_scale = (None if arch.embedding_scale is None
                                else float(torch.tensor(arch.embedding_scale, dtype=dtype, device="cpu")))
        # One cos/sin table for all layers: at 128k positions it is 64 MB, which per layer would be 2 GB for 32.
        # Sliding-window layers may have their own (Gemma 3's local base); layers without RoPE get none.
        rotary_emb = RotaryEmbedding(arch.head_dim, arch.rotary_length, arch.rope)
        local_rotary_emb = (rotary_emb if arch.rope_local is None
                            else RotaryEmbedding(arch.head_dim, arch.rotary_length, arch.rope_local))

        def rotary_of(i: int) -> RotaryEmbedding | None:
            if not arch.has_rope(i):
                return None
            return local_rotary_emb if arch.window(i) is not None else rotary_emb

        # Each linear layer's method by its name and the checkpoint modules it merges.
        quant_method = functools.partial(get_quant_method, quant_config)

        self.layers = nn.ModuleList(
            layer_cls(arch, i, dtype, quant_method, f"model.layers.{i}", rotary_of(i), parallel, packed_modules)
            if i in self.stage_layers else nn.Identity()
            for i in range(arch.num_layers)
        )
        if parallel.is_last_stage:
            self.norm = make_norm(arch, arch.hidden_size, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            hidden_states = hidden_states * self.embedding_scale
        return hidden_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        if self.parallel.is_first_stage:
            hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            if intermediate_tensors is None:
                raise ValueError("a pipeline stage after the first needs the previous stage's intermediate tensors")
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for i in self.stage_layers:
            hidden_states, residual = self.layers[i](positions, hidden_states, residual, attn_metadata)
        if not self.parallel.is_last_stage:
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM with Llama's checkpoint names (`model.embed_tokens`, `model.layers.N`,
    `model.norm`, `lm_head`). A family overrides `arch_config` and, where its layers differ, `layer_cls`."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    skipped_checkpoint_suffixes: ClassVar[tuple[str, ...]] = (
        "rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
        # FP8 KV cache scales: read by the worker when it sizes the cache, not parameters here.
        *(f"self_attn{suffix}" for suffix in KV_SCALE_NAMES.suffixes),
    )
    layer_cls: ClassVar[type[nn.Module]] = DecoderLayer
    has_lm_head: ClassVar[bool] = True  # False: a classifier, whose last stage holds its own head instead
    _LAYER_PREFIX: ClassVar[str] = "model.layers."
    _EMBEDDING: ClassVar[str] = "model.embed_tokens.weight"
    _LAST_STAGE_PREFIXES: ClassVar[tuple[str, ...]] = ("model.norm.", "lm_head.")

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None, parallel: ParallelContext | None = None,
                 max_model_len: int | None = None) -> None:
        """`max_model_len`: the context the engine serves (default: config.json's max_position_embeddings), for
        which length-dependent RoPE scaling (dynamic NTK, LongRoPE) is computed."""
        super().__init__()
        self.hf_config = hf_config
        self.dtype = dtype
        self.parallel = parallel or single_process()
        config = self.arch_config(hf_config)
        if max_model_len is not None:
            config = dataclasses.replace(config, context_len=max_model_len)
        self.config = config
        self.hidden_size = self.config.hidden_size
        self.vocab_size = self.config.vocab_size
        self.model = DecoderModel(self.config, dtype, quant_config, self.parallel, self.layer_cls,
                                  self.packed_modules_mapping)
        if isinstance(quant_config, QuantPlan):
            quant_config.check_unquantized("lm_head")
        if self.parallel.is_last_stage and self.has_lm_head:
            # A last stage that is not the first has no embedding to tie to: it loads the embedding's tensor.
            tie = self.model.embed_tokens if self.config.tie_word_embeddings and self.parallel.is_first_stage else None
            self.lm_head = LMHead(self.config.vocab_size, self.config.hidden_size, dtype, tie_to=tie,
                                  parallel=self.parallel)

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return DecoderArch.from_hf(hf)

    # ----- the step ---------------------------------------------------------------------------------------

    supported_modalities: ClassVar[frozenset[str]] = frozenset()  # a text-only model takes no media

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def intermediate_specs(self, num_tokens: int) -> dict[str, TensorSpec]:
        spec = ((num_tokens, self.hidden_size), self.dtype)
        return {"hidden_states": spec, "residual": spec}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits. Under pipeline parallelism only the last stage has an LM head: it alone samples, and
        the other stages learn the sampled ids from the engine (kestrel.executor.worker)."""
        logits = self.lm_head(hidden_states)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        cap = self.config.final_logit_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """An embedding is the pooled hidden state itself."""
        return pooled

    def decoder_layers(self) -> list[nn.Module]:
        return [self.model.layers[i] for i in self.model.stage_layers]

    def attention_layers(self) -> list[Attention]:
        """This stage's Attention modules in layer order, for the runner to bind one KV cache each."""
        return [m for layer in self.decoder_layers() for m in layer.modules() if isinstance(m, Attention)]

    def get_input_embeddings(self) -> nn.Module | None:
        """The token embedding (first pipeline stage only)."""
        return self.model.embed_tokens if self.parallel.is_first_stage else None

    # ----- checkpoint -------------------------------------------------------------------------------------

    def owns_checkpoint_tensor(self, hf_name: str) -> bool:
        """False for a tensor that belongs to another pipeline stage."""
        if self.parallel.pp_size == 1:
            return True
        if hf_name.startswith(self._LAYER_PREFIX):
            return int(hf_name[len(self._LAYER_PREFIX):].split(".", 1)[0]) in self.model.stage_layers
        if hf_name == self._EMBEDDING:
            tied_here = self.config.tie_word_embeddings and self.parallel.is_last_stage and self.has_lm_head
            return self.parallel.is_first_stage or tied_here
        if hf_name.startswith(self._LAST_STAGE_PREFIXES):
            return self.parallel.is_last_stage
        return True

    def checkpoint_target(self, hf_name: str) -> str | None:
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if not self.owns_checkpoint_tensor(hf_name):
            return None
        if hf_name == self._EMBEDDING and not self.parallel.is_first_stage and self.has_lm_head:
            return "lm_head.weight"  # the tied head of a last stage without the embedding
        return hf_name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) in, check that every parameter was loaded, then let the quant
        methods post-process."""
        loading.load_weights(self, weights)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        process_linear_layers_after_loading(self)


class ClassificationHead(nn.Module):
    """A sequence classifier's `score`: `Linear(hidden, num_labels, bias=False)`, replicated on every rank and kept
    unquantized (it is tiny); float32 logits."""

    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ops.linear(hidden_states.to(self.weight.dtype), self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]}, num_labels={self.weight.shape[0]}"


class SequenceClassifier:
    """Mixed into a family's causal LM class: transformers' `<Family>ForSequenceClassification`, the decoder and a
    `score` head (checkpoint `score.weight`) in place of the LM head, pooled at the last token by the pooling
    runner (`pooler_head`). A pooling request still samples one unread greedy token, over the labels'
    logits (`compute_logits`)."""

    has_lm_head: ClassVar[bool] = False
    _LAST_STAGE_PREFIXES: ClassVar[tuple[str, ...]] = ("model.norm.", "score.")

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                 quant_config: Quantization = None, parallel: ParallelContext | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(hf_config, dtype, quant_config, parallel, max_model_len)  # type: ignore[call-arg]
        self.num_labels = num_labels(hf_config)
        if self.parallel.is_last_stage:
            self.score = ClassificationHead(self.hidden_size, self.num_labels, dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.score(hidden_states)

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled)

    def checkpoint_target(self, hf_name: str) -> str | None:
        if hf_name.startswith("lm_head."):
            return None  # a checkpoint converted from a causal LM may keep it; the classifier never reads it
        return super().checkpoint_target(hf_name)  # type: ignore[misc]
