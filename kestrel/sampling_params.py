"""SamplingParams: the same names and defaults as vLLM, validated on construction and on every assignment.

This module is the one source of sampling defaults and bounds: the server's request models and the command
line's sampling flags read `SamplingParams.default(name)` and `SAMPLING_BOUNDS` rather than restating them.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

_GREEDY_EPSILON = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it and what is allowed."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Bound:
    """The values a numeric sampling parameter may take; `allowed` says them in an error message."""

    allowed: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    integer: bool = False
    optional: bool = False  # None is allowed too (no limit, or nothing asked)

    def admits(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if not (_is_int(value) if self.integer else _is_number(value)) or not math.isfinite(value):
            return False  # NaN, and infinity, which no parameter means (temperature=inf sampled uniformly)
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def json_schema(self) -> dict[str, float]:
        """The bound as JSON Schema keywords, for the server's OpenAPI document."""
        keywords = {"minimum": self.ge, "exclusiveMinimum": self.gt, "maximum": self.le}
        return {key: value for key, value in keywords.items() if value is not None}


# The range of every numeric SamplingParams field, as given (before top_k's -1 and seed's -1 become their
# canonical 0 and None). SamplingParams checks them on construction; the server's request models check a request's
# values against the same table while parsing it.
SAMPLING_BOUNDS: Mapping[str, Bound] = MappingProxyType({
    "n": Bound("an integer >= 1", ge=1, integer=True),
    "presence_penalty": Bound("in [-2, 2]", ge=-2.0, le=2.0),
    "frequency_penalty": Bound("in [-2, 2]", ge=-2.0, le=2.0),
    "repetition_penalty": Bound("> 0", gt=0.0),
    "temperature": Bound(">= 0 (0 means greedy)", ge=0.0),
    "top_p": Bound("in (0, 1]", gt=0.0, le=1.0),
    "top_k": Bound("an integer >= 0 (0 or -1 disables it)", ge=-1, integer=True),
    "min_p": Bound("in [0, 1]", ge=0.0, le=1.0),
    "max_tokens": Bound("an integer >= 1 or None", ge=1, integer=True, optional=True),
    "min_tokens": Bound("an integer >= 0", ge=0, integer=True),
    "logprobs": Bound("an integer >= 0 or None", ge=0, integer=True, optional=True),
    "prompt_logprobs": Bound("an integer >= 0 or None", ge=0, integer=True, optional=True),
})


def check_bound(name: str, value: Any, param: str | None = None) -> None:
    """Raise SamplingParamsError unless `value` is in SAMPLING_BOUNDS[name]; `param`: the name the error gives
    (a request field that sets this parameter under another name, such as max_completion_tokens)."""
    bound = SAMPLING_BOUNDS[name]
    if not bound.admits(value):
        param = param or name
        raise SamplingParamsError(param, f"{param} must be {bound.allowed}, got {value!r}")


def sibling_seed(seed: int | None, index: int) -> int | None:
    """The seed of sequence `index` of a request that asks for n > 1 (distinct seeds keep seeded siblings from
    sampling identical sequences), wrapped into the 64 bits a seed may have."""
    return None if seed is None else (seed + index + (1 << 63)) % (1 << 64) - (1 << 63)


OUTPUT_KINDS = ("cumulative", "delta", "final_only")


class RequestOutputKind(enum.IntEnum):
    """vLLM's names for `SamplingParams.output_kind` (its values too); SamplingParams keeps the lower-case name."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class ThinkingTags:
    """A reasoning model's thinking ahead of a constrained answer (`StructuredOutputsParams.after_thinking`): the
    grammar waits while the answer thinks and applies from the token after `end_token_id`. `open`: the answer starts
    inside its thinking (the prompt opened it); otherwise its first token may open it (`start_token_id`, which the
    grammar's first mask then also allows) and any other first token starts the grammar at once."""

    start_token_id: int
    end_token_id: int
    open: bool = False

    def __post_init__(self) -> None:
        for name in ("start_token_id", "end_token_id"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise SamplingParamsError(f"structured_outputs.after_thinking.{name}",
                                          f"{name} must be a token id (an integer >= 0), got {value!r}")
        if self.start_token_id == self.end_token_id:
            raise SamplingParamsError("structured_outputs.after_thinking", "the thinking's start and end tokens "
                                      f"must differ, got {self.start_token_id} for both")
        if not isinstance(self.open, bool):
            raise SamplingParamsError("structured_outputs.after_thinking.open",
                                      f"open must be true or false, got {self.open!r}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names): exactly one of a JSON schema (`json`, a dict or its
    JSON text), any JSON object (`json_object`), a regular expression, a list of choices, or an EBNF grammar
    (GBNF-style, as xgrammar reads it)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without whitespace between tokens (vLLM's disable_any_whitespace).
    disable_any_whitespace: bool = False
    # The grammar applies after the answer's thinking (`kestrel serve --reasoning-parser` sets it for chats);
    # None: from the first token.
    after_thinking: ThinkingTags | None = None

    def __post_init__(self) -> None:
        if self.after_thinking is not None and not isinstance(self.after_thinking, ThinkingTags):
            raise SamplingParamsError("structured_outputs.after_thinking", "after_thinking must be a ThinkingTags "
                                      f"(the thinking's start and end token ids), got {self.after_thinking!r}")
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", f"structured_outputs takes exactly one of "
                                      f"{list(STRUCTURED_OUTPUT_KINDS)}, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise SamplingParamsError("structured_outputs.json", "json must be a JSON schema (a dict or its text)")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise SamplingParamsError("structured_outputs.choice", "choice must be a non-empty list of non-empty "
                                      "strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"structured_outputs.{name}", f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False))


# The marker pair a caller puts around text that prompt compression must keep verbatim; the markers themselves are
# removed from the prompt whenever prompt_compression is asked for.
KEEP_MARKERS: tuple[str, str] = ("<kestrel:keep>", "</kestrel:keep>")


@dataclass(frozen=True)
class PromptCompression:
    """Prompt compression (a kestrel extension, docs/long-context.md "Prompt compression"): the engine's compressor
    model drops the prompt's least informative tokens until about `rate` of them are left. Kept verbatim: the chat
    template's own text (special tokens, role markers), the system messages (`keep_system`) and the last user
    message (`keep_last_user_turn`) of a chat, fenced code blocks when `keep_code_blocks`, the character spans of
    `keep_spans` (offsets into a text prompt as sent) and text between KEEP_MARKERS. `keep_system` and
    `keep_last_user_turn` are None when not given: True for a chat, and a text prompt has no roles to keep."""

    rate: float
    keep_last_user_turn: bool | None = None
    keep_system: bool | None = None
    keep_code_blocks: bool = False
    keep_spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not _is_number(self.rate) or math.isnan(self.rate) or not 0.0 < self.rate <= 1.0:
            raise SamplingParamsError("prompt_compression.rate", f"prompt_compression.rate must be in (0, 1] (the "
                                      f"share of the prompt's tokens kept), got {self.rate!r}")
        for name in ("keep_last_user_turn", "keep_system"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"prompt_compression.{name}", f"prompt_compression.{name} must be true or "
                                          f"false, got {getattr(self, name)!r}")
        if not isinstance(self.keep_code_blocks, bool):
            raise SamplingParamsError("prompt_compression.keep_code_blocks", "prompt_compression.keep_code_blocks "
                                      f"must be true or false, got {self.keep_code_blocks!r}")
        spans = self.keep_spans
        if not isinstance(spans, list | tuple) or any(
                not isinstance(span, list | tuple) or len(span) != 2 or not all(_is_int(v) for v in span)
                or not 0 <= span[0] < span[1] for span in spans):
            raise SamplingParamsError("prompt_compression.keep_spans", "prompt_compression.keep_spans must be a list "
                                      f"of [start, end] character offsets with 0 <= start < end, got {spans!r}")
        object.__setattr__(self, "keep_spans", tuple((int(a), int(b)) for a, b in spans))

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> PromptCompression:
        """The request's dict, strictly: unknown keys and a missing rate are errors naming the field."""
        if not isinstance(value, Mapping):
            raise SamplingParamsError("prompt_compression", "prompt_compression must be an object such as "
                                      f'{{"rate": 0.5}}, got {value!r}')
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise SamplingParamsError(f"prompt_compression.{unknown[0]}", f"prompt_compression has unknown keys "
                                      f"{unknown}; known: {known}")
        if "rate" not in value:
            raise SamplingParamsError("prompt_compression.rate", "prompt_compression needs a rate in (0, 1]")
        return cls(**value)


@dataclass
class SamplingParams:
    """vLLM's sampling settings of one request. Like vLLM's, a field may be assigned after construction
    (`params.max_tokens = 32`); the assignment is checked as a new SamplingParams would be, and a refused value
    leaves the params as they were. The engines take a copy at submission (`clone`), so a later assignment never
    reaches a request in flight."""

    # The temperature of greedy decoding, for callers whose default is greedy on purpose (beam search, the
    # command line).
    GREEDY_TEMPERATURE: ClassVar[float] = 0.0

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: False leaves the output's text empty and its logprobs' decoded_token None (token ids only); stop
    # strings need the text, so they are refused with it.
    detokenize: bool = True
    # "cumulative": an output at every step (text and token ids so far, plus deltas), for streaming;
    # "delta": an output at every step holding only what the step added (text, token_ids and logprobs are the
    # deltas), which spares copying the whole output each step; "final_only": one output when the request
    # finishes, which spares the per-step detokenization and output objects of offline runs (the text is
    # identical). A RequestOutputKind (vLLM's enum) is taken by its name.
    output_kind: str = "cumulative"
    # token id -> value added to its logit before sampling (greedy too), OpenAI's range [-100, 100].
    logit_bias: dict[int, float] | None = None
    # Sampling (greedy too) only ever picks one of these token ids (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's bad_words): the last token of a word is banned wherever the tokens before it
    # end the output. The engine fills bad_words_token_ids from them (with and without a leading space).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Constrained decoding (vLLM's structured_outputs): every token is one the grammar allows.
    structured_outputs: StructuredOutputsParams | None = None
    # A kestrel extension: shorten the prompt before it reaches the engine (the LLM and the server do it, then hand
    # the engine the compressed prompt with this field cleared). A dict is read by PromptCompression.from_dict.
    prompt_compression: PromptCompression | None = None
    # vLLM's: keep the prompt's last N tokens (-1: max_model_len tokens). LLM and AsyncLLM cut the prompt and hand
    # the engine the rest with this field cleared.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.output_kind, enum.Enum):
            object.__setattr__(self, "output_kind", self.output_kind.name.lower())
        if isinstance(self.prompt_compression, Mapping):
            object.__setattr__(self, "prompt_compression", PromptCompression.from_dict(self.prompt_compression))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        for name, allowed in (("stop", "a string or a list of strings"), ("stop_token_ids", "a list of token ids")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, Mapping) or not hasattr(value, "__iter__")):
                raise SamplingParamsError(name, f"{name} must be {allowed}, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, list(value or []))
        if self.top_k is None or self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed == -1 and _is_int(self.seed):  # vLLM's spelling of "no seed": random sampling
            object.__setattr__(self, "seed", None)
        self._validate()
        object.__setattr__(self, "_checked", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_checked"):  # the constructor's own assignments, checked by __post_init__
            object.__setattr__(self, name, value)
            return
        if name not in _FIELD_DEFAULTS:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        checked = dataclasses.replace(self, **{name: value})  # normalized and checked as a new one would be
        for field_name in _FIELD_DEFAULTS:
            object.__setattr__(self, field_name, getattr(checked, field_name))

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `clone`): what the engines keep of a submitted request's params."""
        return copy.deepcopy(self)

    def _validate(self) -> None:
        def bad(param: str, allowed: str) -> None:
            raise SamplingParamsError(param, f"{param} must be {allowed}, got {getattr(self, param)!r}")

        for name in SAMPLING_BOUNDS:
            check_bound(name, getattr(self, name))
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < (1 << 63)):
            bad("seed", "a 64-bit signed integer or None")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens={self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of token ids >= 0")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or any(not _is_int(t) or t < 0 for t in self.logit_bias)
                or any(not isinstance(v, int | float) or not -100.0 <= v <= 100.0 for v in self.logit_bias.values())):
            bad("logit_bias", "a dict of token id (>= 0) -> bias in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list | tuple) or not self.allowed_token_ids
                or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "a non-empty list of token ids >= 0")
        if self.bad_words is not None and (not isinstance(self.bad_words, list | tuple) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            bad("bad_words", "a list of non-empty strings")
        if self.bad_words_token_ids is not None and any(
                not seq or any(not _is_int(t) or t < 0 for t in seq) for seq in self.bad_words_token_ids):
            bad("bad_words_token_ids", "a list of non-empty token id lists")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "a StructuredOutputsParams")
        if self.structured_outputs is not None:
            # Each could leave no token the grammar allows (min_tokens bans the EOS a finished grammar needs).
            for name, unset in (("min_tokens", 0), ("allowed_token_ids", None), ("bad_words", None)):
                if getattr(self, name) not in (unset, [], ()):
                    bad(name, f"{unset!r} with structured_outputs (the grammar decides which tokens may "
                        "come, and when the output ends)")
        if not isinstance(self.detokenize, bool):
            bad("detokenize", "true or false")
        if not self.detokenize and self.stop:
            bad("stop", "empty with detokenize=False (stop strings are matched in the text; stop_token_ids end a "
                "request by its token ids)")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"one of {list(OUTPUT_KINDS)}")
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or not (self.truncate_prompt_tokens >= 1
                                                                 or self.truncate_prompt_tokens == -1)):
            bad("truncate_prompt_tokens", "an integer >= 1, -1 (max_model_len tokens) or None")
        if self.prompt_compression is not None and not isinstance(self.prompt_compression, PromptCompression):
            bad("prompt_compression", "a PromptCompression or a dict such as {'rate': 0.5}")

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field `name` (a fresh one for a list)."""
        return _FIELD_DEFAULTS[name]()

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every field's default: the arguments of SamplingParams()."""
        return {name: make() for name, make in _FIELD_DEFAULTS.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def final_only(self) -> bool:
        return self.output_kind == "final_only"

    @property
    def delta_outputs(self) -> bool:
        return self.output_kind == "delta"

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search settings (`LLM.beam_search`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    # Of the one token each beam samples, an extra candidate besides its top 2 x beam_width (whose logprobs are
    # the model's raw ones); greedy by default (vLLM's), which is always among the top.
    temperature: float = SamplingParams.GREEDY_TEMPERATURE
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep a final EOS token's text in `text`

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SamplingParamsError(name, f"{name} must be an integer >= 1, got {value!r}")
        check_bound("temperature", self.temperature)
        if not isinstance(self.length_penalty, int | float) or self.length_penalty != self.length_penalty:
            raise SamplingParamsError("length_penalty", f"length_penalty must be a number, got "
                                      f"{self.length_penalty!r}")

    def step_params(self) -> SamplingParams:
        """One round of one beam: a single token and its candidates."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True, output_kind="final_only")


_FIELD_DEFAULTS: dict[str, Any] = {
    f.name: (f.default_factory if f.default is dataclasses.MISSING else (lambda value=f.default: value))
    for f in dataclasses.fields(SamplingParams)}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
