"""What the pooling endpoints and `LLM.embed` / `classify` / `score` / `encode` share, free of HTTP: the model's
embedding settings, Matryoshka `dimensions`, which model serves which task, the pairing of score inputs, and the
arithmetic that turns pooled outputs into probabilities and scores (docs/models.md, "Pooling")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

from kestrel.config import ModelConfig
from kestrel.pooling_params import PoolingParams
from kestrel.request import InvalidRequestError

T = TypeVar("T")


def is_classifier(model: ModelConfig) -> bool:
    return model.pooler is not None and model.pooler.task == "classify"


def matryoshka_dimensions(hf_config: dict[str, Any]) -> tuple[bool, tuple[int, ...] | None]:
    """Whether the checkpoint was trained for Matryoshka truncation (config.json's `is_matryoshka` or
    `matryoshka_dimensions`, vLLM's keys), and the sizes it names (None: any size)."""
    sizes = hf_config.get("matryoshka_dimensions")
    if sizes:
        return True, tuple(int(s) for s in sizes)
    return bool(hf_config.get("is_matryoshka")), None


def checked_dimensions(hf_config: dict[str, Any], dimensions: int | None, param: str = "dimensions") -> int | None:
    """`dimensions` where the model was trained for it; None (the whole vector) when it asks for all of it.
    `param`: the argument's name, for errors."""
    if dimensions is None:
        return None
    matryoshka, sizes = matryoshka_dimensions(hf_config)
    hidden_size = int(hf_config.get("hidden_size") or 0)
    if not matryoshka:
        raise InvalidRequestError(param, f"{param}={dimensions}: this model does not support Matryoshka truncation, "
                                  f"so its embeddings cannot be shortened: leave {param} out")
    if sizes is not None and dimensions not in sizes:
        raise InvalidRequestError(param, f"{param}={dimensions} is not one this model was trained for: "
                                  f"{list(sizes)}")
    if hidden_size and dimensions > hidden_size:
        raise InvalidRequestError(param, f"{param}={dimensions} is more than the model's {hidden_size}")
    return None if dimensions == hidden_size else dimensions


def embedding_params(model: ModelConfig, dimensions: int | None = None) -> PoolingParams:
    """How this model embeds: the pooling runner's settings, else (a generation model) last token, normalized."""
    pooler = model.pooler
    if pooler is None:
        return PoolingParams(normalize=True, dimensions=dimensions, pooling_type="LAST")
    return PoolingParams(normalize=pooler.normalize, dimensions=dimensions, pooling_type=pooler.pooling_type)


def classifier_params(model: ModelConfig) -> PoolingParams:
    """A classifier's raw logits: its head over the checkpoint's pooling, never normalized."""
    pooling_type = model.pooler.pooling_type if model.pooler is not None else "LAST"
    return PoolingParams(normalize=False, pooling_type=pooling_type)


def refuse_classifier(model: ModelConfig, caller: str, instead: tuple[str, ...], scoring: tuple[str, ...] = ()
                      ) -> None:
    """A classification model has no embeddings: its pooled output is its labels' logits. `caller`: the endpoint
    or method refused; `instead`: what serves any classifier; `scoring`: what serves one with a single label (a
    cross-encoder) too."""
    if is_classifier(model):
        single = model.pooler is None or model.pooler.num_labels == 1
        serving = (*scoring, *instead) if single else instead
        raise InvalidRequestError("model", f"{model.architecture} is a classifier: it has no embeddings for "
                                  f"{caller}; use {', '.join(serving[:-1])} or {serving[-1]}")


def require_classifier(model: ModelConfig, caller: str) -> None:
    if not is_classifier(model):
        runner = "the generate runner" if model.pooler is None else "an embedding model under the pooling runner"
        raise InvalidRequestError("model", f"{model.architecture} is not a classifier ({runner}): {caller} needs a "
                                  "*ForSequenceClassification checkpoint run with runner='pooling' (--runner "
                                  "pooling)")


def require_cross_encoder(model: ModelConfig, instead: str) -> None:
    """Scoring with a classifier reads its one logit; `instead`: what gives a multi-label model's output."""
    if model.pooler is not None and model.pooler.num_labels != 1:
        raise InvalidRequestError("model", f"{model.architecture} has {model.pooler.num_labels} labels; scoring "
                                  f"needs a cross-encoder with one (use {instead} for its label probabilities)")


def score_pairs(text_1: T | Sequence[T], text_2: T | Sequence[T],
                names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[T, T]]:
    """vLLM's pairing: one text_1 against every text_2, or two lists of equal length by position. A str or a
    dict is one item; `names`: the two arguments' names, for errors."""
    firsts = [text_1] if isinstance(text_1, str | dict) else list(text_1)  # type: ignore[arg-type]
    seconds = [text_2] if isinstance(text_2, str | dict) else list(text_2)  # type: ignore[arg-type]
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise InvalidRequestError(names[1], f"{names[0]} has {len(firsts)} texts and {names[1]} has "
                                  f"{len(seconds)}: give one {names[0]} to score against every {names[1]}, or as "
                                  f"many {names[0]} as {names[1]}")
    return list(zip(firsts, seconds))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def label_probs(logits: Sequence[float]) -> list[float]:
    """A classifier's label probabilities: softmax over its labels, the sigmoid for one label (as transformers'
    and sentence-transformers' CrossEncoder read a single logit)."""
    if len(logits) == 1:
        return [sigmoid(logits[0])]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity, in float64 (an embedding model's score of a pair)."""
    dot = sum(x * y for x, y in zip(a, b))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms else 0.0
