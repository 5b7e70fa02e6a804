"""OpenAI request and response schemas: the only place request JSON is parsed and checked.

Request models are strict (no "5" for 5, no NaN) so a wrong type is a 400 naming the field,
not a silent coercion; unknown fields are refused by name (NOT_SUPPORTED_FIELDS). Checks that span
fields raise InvalidRequestError(param, message). Sampling defaults and ranges are SamplingParams':
a field's default reads `SamplingParams.default`, its range is `SAMPLING_BOUNDS`, checked while the
request is parsed, and a field left unset takes the model's generation_config or SamplingParams'
default when the request becomes SamplingParams.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kestrel.entrypoints.chat import check_final_message_continued
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import (
    SAMPLING_BOUNDS,
    BeamSearchParams,
    PromptCompression,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
    check_bound,
)

MAX_N = 128  # the server's own limit on n, beyond SamplingParams' n >= 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def _integral(value: Any) -> Any:
    # JSON Schema counts 1.0 as an integer; strict mode alone would refuse it.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[Int, Field(ge=0, le=INT64_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Seed = Annotated[Int, Field(ge=INT64_MIN, le=INT64_MAX)]
StopString = Annotated[str, Field(min_length=1)]
_BOUND_ERROR = "sampling_bound"  # pydantic's error type of a value outside SAMPLING_BOUNDS


def _bounded(kind: Any, name: str, param: str | None = None) -> Any:
    """`kind` limited to SamplingParams' range of `name` (SAMPLING_BOUNDS), checked while the request is parsed;
    `param`: the request field when it sets `name` under another name. Out of range, the 400 names the field
    with SamplingParams' own message."""
    def check(value: Any) -> Any:
        try:
            check_bound(name, value, param)
        except SamplingParamsError as error:
            raise PydanticCustomError(_BOUND_ERROR, "{message}", {"message": str(error)}) from None
        return value

    return Annotated[kind, AfterValidator(check), Field(json_schema_extra=SAMPLING_BOUNDS[name].json_schema())]


def _sampling_default(name: str) -> Any:
    return SamplingParams.default(name)


def _check_unicode(value: Any) -> None:
    """Text must be encodable as UTF-8: a lone UTF-16 surrogate (JSON "\\ud800") cannot be tokenized."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the text holds a lone surrogate (U+D800-U+DFFF), which is not valid Unicode; send "
                             "characters outside the BMP as a surrogate pair or as UTF-8") from None
    elif isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, str | list | tuple | dict):
                _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


_OPENAI_PLATFORM = "an OpenAI platform feature that this server does not have"
# Request fields of vLLM and OpenAI that kestrel does not implement yet, with what to do instead. Any other
# unknown field is refused too: a field is honoured or refused, never ignored.
NOT_SUPPORTED_FIELDS: dict[str, str] = {
    "guided_whitespace_pattern": "a custom whitespace pattern is not supported; use structured_outputs with "
                                 "disable_any_whitespace",
    "structural_tag": "structural tags are not supported; use structured_outputs (json, regex, choice, grammar)",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "best_of": "best_of is not supported on chat completions; use n",
    "add_special_tokens": "on chat completions the template places the special tokens (add_special_tokens false)",
    "documents": "documents for retrieval templates are not implemented",
    "mm_processor_kwargs": "per-request processor settings are not supported; the server's --mm-processor-kwargs "
                           "applies to every request",
    "logits_processors": "custom logits processors are not implemented",
    "kv_transfer_params": "KV transfer is not implemented",
    "vllm_xargs": "vLLM's extension arguments are not implemented",
    **{name: _OPENAI_PLATFORM for name in ("store", "metadata", "service_tier", "modalities",
                                           "audio", "prediction", "web_search_options", "verbosity",
                                           "safety_identifier", "prompt_cache_key")},
    "functions": "the deprecated functions field is not supported; use tools",
    "function_call": "the deprecated function_call field is not supported; use tool_choice",
}
_EMPTY_VALUES: tuple[Any, ...] = (None, [], {})
# vLLM and OpenAI fields sent with the value that asks for nothing beyond what kestrel does anyway (their defaults):
# chat completions are never stored.
_NO_OP_VALUES: dict[str, Any] = {"add_special_tokens": False, "store": False, "service_tier": ("auto", "default"),
                                  "modalities": (["text"],)}
# With use_beam_search, only these fields take effect (n is the beam width); any other one set is refused.
_BEAM_SEARCH_FIELDS = frozenset({
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "ignore_eos",
    "length_penalty", "include_stop_str_in_output", "use_beam_search", "stream", "user", "echo",
    "add_special_tokens", "truncate_prompt_tokens", "priority", "add_generation_prompt", "continue_final_message",
    "chat_template", "chat_template_kwargs", "request_id"})


def capped_max_tokens(max_tokens: int | None, model_limit: int | None) -> int | None:
    """A request's max_tokens (None: up to the context) under the model's generation_config max_new_tokens."""
    if model_limit is None:
        return max_tokens
    return model_limit if max_tokens is None else min(max_tokens, model_limit)


def _asks_nothing(name: str, value: Any) -> bool:
    """Null or empty, or a value naming what the server does anyway (OpenAI's default service tier, text output)."""
    if value in _EMPTY_VALUES or name not in _NO_OP_VALUES:
        return value in _EMPTY_VALUES
    no_op = _NO_OP_VALUES[name]
    return value is no_op if isinstance(no_op, bool) else value in no_op


class _Request(BaseModel):
    # Unknown fields are errors (validation_error_info names them); see NOT_SUPPORTED_FIELDS.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unknown_empty_fields_carry_nothing(cls, data: Any) -> Any:
        """An unknown field set to null or empty, or a vLLM field set to its no-op default, asks for nothing, so
        nothing is ignored by dropping it; clients replaying OpenAI responses send such fields (a message's
        `refusal: null`, `annotations: []`), vLLM clients `use_beam_search: false`."""
        if isinstance(data, dict) and any(k not in cls.model_fields and _asks_nothing(k, v) for k, v in data.items()):
            return {k: v for k, v in data.items() if k in cls.model_fields or not _asks_nothing(k, v)}
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_unicode(value)
        return value


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, the usage so far in every chunk


class PromptCompressionRequest(_Request):
    """A kestrel extension (docs/long-context.md, "Prompt compression"): PromptCompression's fields."""

    rate: Annotated[float, Field(gt=0.0, le=1.0)]
    keep_last_user_turn: bool | None = None
    keep_system: bool | None = None
    keep_code_blocks: bool | None = None
    keep_spans: list[Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=2, max_length=2)]] | None = None

    def params(self) -> PromptCompression:
        return PromptCompression(rate=self.rate, keep_last_user_turn=self.keep_last_user_turn,
                                 keep_system=self.keep_system, keep_code_blocks=bool(self.keep_code_blocks),
                                 keep_spans=tuple((a, b) for a, b in self.keep_spans or ()))


class _SamplingRequest(_Request):
    """Fields shared by completions and chat: OpenAI's sampling fields plus vLLM's extensions."""

    model: str | None = None
    n: _bounded(Annotated[Int, Field(le=MAX_N)], "n") | None = _sampling_default("n")
    # None: the model's generation_config value (GENERATION_SAMPLING_KEYS), else SamplingParams' default.
    temperature: _bounded(float, "temperature") | None = None
    top_p: _bounded(float, "top_p") | None = None
    top_k: _bounded(Int, "top_k") | None = None
    min_p: _bounded(float, "min_p") | None = None
    repetition_penalty: _bounded(float, "repetition_penalty") | None = None
    presence_penalty: _bounded(float, "presence_penalty") | None = _sampling_default("presence_penalty")
    frequency_penalty: _bounded(float, "frequency_penalty") | None = _sampling_default("frequency_penalty")
    seed: Seed | None = None
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: _bounded(Int, "min_tokens") | None = _sampling_default("min_tokens")
    ignore_eos: bool | None = _sampling_default("ignore_eos")
    skip_special_tokens: bool | None = _sampling_default("skip_special_tokens")
    spaces_between_special_tokens: bool | None = _sampling_default("spaces_between_special_tokens")
    include_stop_str_in_output: bool | None = _sampling_default("include_stop_str_in_output")
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None  # keep the prompt's last N tokens
    prompt_logprobs: _bounded(Int, "prompt_logprobs") | None = None  # vLLM's: each prompt token's logprob and top-N
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprob tokens as "token_id:N" (for unprintable ones)
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the output's token ids in the response
    priority: Int | None = None  # vLLM's: lower first, when the server runs --scheduling-policy priority
    # vLLM's: part of the first prefix-cache block's hash, so only requests with the same salt share cached blocks
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's: the request's id in the engine and the logs, and the response's after its prefix ("chatcmpl-ID");
    # one in use by a request still running is a 400.
    request_id: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")] | None = None
    # vLLM's constrained decoding; the guided_* spellings are vLLM's older names for the same.
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    response_format: ResponseFormat | None = None
    use_beam_search: bool | None = None  # vLLM's: the n best beams instead of n samples
    length_penalty: float | None = None  # beam scores: cum_logprob / length ** length_penalty
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    prompt_compression: PromptCompressionRequest | None = None  # kestrel's: shorten the prompt first

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def usage_in_every_chunk(self) -> bool:
        """vLLM's continuous usage stats: asked for together with include_usage."""
        return self.include_usage_in_stream and bool(self.stream_options.continuous_usage_stats)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            _unsupported("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            _unsupported("prompt_logprobs", "prompt_logprobs are not available when stream is true")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         model_defaults: Mapping[str, Any]) -> SamplingParams:
        """`model_defaults`: the model's generation_config settings, for the fields the request leaves unset (or
        sets to null); SamplingParams' defaults fill in the rest. Its max_tokens (generation_config's
        max_new_tokens) caps `max_tokens`, as vLLM reads it."""
        model_defaults = dict(model_defaults)
        max_tokens = capped_max_tokens(max_tokens, model_defaults.pop("max_tokens", None))
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            **{**model_defaults, **given},
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.structured_outputs_params(),
            logit_bias=self._token_bias(),
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids else None,
            bad_words=list(self.bad_words) if self.bad_words else None,
            prompt_compression=self.prompt_compression.params() if self.prompt_compression is not None else None,
        )

    @property
    def structured_outputs_field(self) -> str:
        """The request field its grammar came from, for errors about that grammar."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        guided = [n for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if getattr(self, n)]
        return guided[0] if guided and self.structured_outputs is None else "structured_outputs"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one grammar, from response_format, structured_outputs or the guided_* fields; asking
        in two places is an error naming both."""
        asked: list[tuple[str, StructuredOutputsParams]] = []
        if self.response_format is not None and self.response_format.type != "text":
            asked.append(("response_format", self._response_format_params(self.response_format)))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self._structured_outputs_request(self.structured_outputs)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, _structured(name, **{kind: _schema(name, value) if kind == "json" else value})))
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            _unsupported("guided_decoding_backend", f"the grammar backend is xgrammar; got "
                         f"{self.guided_decoding_backend!r}")
        if len(asked) > 1:
            _unsupported(asked[1][0], f"{asked[0][0]} and {asked[1][0]} both constrain the output; give one")
        return asked[0][1] if asked else None

    @staticmethod
    def _response_format_params(fmt: ResponseFormat) -> StructuredOutputsParams:
        if fmt.type == "json_object":
            if fmt.json_schema is not None:
                _unsupported("response_format.json_schema", "json_schema goes with type 'json_schema'")
            return _structured("response_format", json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            _unsupported("response_format.json_schema", "type 'json_schema' needs json_schema.schema")
        return _structured("response_format.json_schema", json=fmt.json_schema.schema_)

    @staticmethod
    def _structured_outputs_request(request: StructuredOutputsRequest) -> StructuredOutputsParams:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(request, name) is not None:
                _unsupported(f"structured_outputs.{name}", NOT_SUPPORTED_FIELDS[name if name != "whitespace_pattern"
                                                                                else "guided_whitespace_pattern"])
        if request.disable_additional_properties:
            _unsupported("structured_outputs.disable_additional_properties", "set additionalProperties false in "
                         "the schema itself")
        json_value = _schema("structured_outputs.json", request.json_) if request.json_ is not None else None
        return _structured("structured_outputs", json=json_value, regex=request.regex, choice=request.choice,
                           grammar=request.grammar, json_object=request.json_object,
                           disable_any_whitespace=bool(request.disable_any_whitespace))

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None:
        """vLLM's use_beam_search: BeamSearchParams (n beams), or None for sampling. A field that beam search
        does not use is refused by name rather than dropped."""
        if not self.use_beam_search:
            # 1.0 (vLLM's default, which clients send as given) changes nothing without beams.
            if self.length_penalty is not None and self.length_penalty != 1.0:
                _unsupported("length_penalty", "length_penalty scores beams; it needs use_beam_search true "
                             "(without it only the default, 1.0, is taken)")
            return None
        if self.stream:
            _unsupported("use_beam_search", "beam search returns whole beams; it cannot stream (set stream false)")
        for name in sorted(self.model_fields_set - _BEAM_SEARCH_FIELDS):
            if not _beam_search_ignores(name, getattr(self, name), type(self).model_fields[name].default):
                _unsupported(name, f"{name} does not apply to beam search (use_beam_search true), which takes n "
                             "(the beam width), max_tokens, temperature, ignore_eos, length_penalty and "
                             "include_stop_str_in_output")
        # Unset fields keep BeamSearchParams' defaults (temperature: greedy).
        given = {name: getattr(self, name) for name in _BEAM_SEARCH_SETTINGS if getattr(self, name) is not None}
        return BeamSearchParams(beam_width=_default(self.n, _sampling_default("n")), max_tokens=max_tokens, **given)

    def _token_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys (strings)."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            # Only plain ASCII digits: int() would also take " 5 ", "1_0" and other scripts' digits ("١").
            if not (key.isascii() and key.isdigit()) or len(key) > 19:
                raise InvalidRequestError("logit_bias", f"logit_bias keys must be token ids written in decimal "
                                          f"digits, got {key!r}")
            bias[int(key)] = value
        return bias


# ----- /v1/completions ----------------------------------------------------------------------------

PromptInput = (str | Annotated[list[str], Field(min_length=1)] | TokenIds
               | Annotated[list[TokenIds], Field(min_length=1)])


def _max_tokens_or_zero(value: Any) -> Any:
    """max_tokens 0 (score the prompt with echo, checked in to_sampling_params) or SamplingParams' range."""
    if value == 0:
        return value
    try:
        check_bound("max_tokens", value)
    except SamplingParamsError as error:
        raise PydanticCustomError(_BOUND_ERROR, "{message}", {"message": str(error).replace(">= 1", ">= 0")}
                                  ) from None
    return value


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    # OpenAI's completions default, which is SamplingParams' too; 0 with echo scores the prompt (vLLM's).
    max_tokens: Annotated[Int, AfterValidator(_max_tokens_or_zero), Field(json_schema_extra={"minimum": 0})] | None = (
        _sampling_default("max_tokens"))
    logprobs: _bounded(Int, "logprobs") | None = _sampling_default("logprobs")
    echo: bool | None = False
    add_special_tokens: bool | None = True  # vLLM's: the tokenizer's BOS (and the like) around a text prompt
    suffix: str | None = None
    best_of: Annotated[Int, Field(ge=1)] | None = None

    @property
    def token_limit(self) -> int | None:
        """max_tokens: SamplingParams' default when left out, None (up to the context, as vLLM reads it) when sent
        as null."""
        return self.max_tokens

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt comes back (with its logprobs when logprobs is set), nothing is
        generated. The engine computes the prompt's logprobs in a one-token run whose token the response drops
        (vLLM does the same)."""
        return bool(self.echo) and self.max_tokens == 0

    def _check_max_tokens(self) -> None:
        if self.max_tokens != 0:
            return
        if not self.echo:
            _unsupported("max_tokens", "max_tokens 0 generates nothing: it only scores the prompt, which needs "
                         "echo true (with logprobs for the prompt's logprobs); otherwise ask for at least 1 token")
        if self.use_beam_search:
            _unsupported("max_tokens", "beam search needs max_tokens >= 1")
        if self.min_tokens:
            _unsupported("min_tokens", f"min_tokens={self.min_tokens} cannot be met with max_tokens 0")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None:
        self._check_max_tokens()
        return super().beam_search_params(max_tokens)

    def to_sampling_params(self, model_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        self._check_common()
        self._check_max_tokens()
        if self.suffix is not None:
            _unsupported("suffix", "suffix (insertion) is not supported by this server")
        if self.best_of is not None and self.best_of != _default(self.n, _sampling_default("n")):
            _unsupported("best_of", "best_of other than n is not supported; use n")
        params = self._sampling_params(1 if self.scores_only else self.token_limit, self.logprobs,
                                       model_defaults or {})
        if self.echo and self.logprobs is not None:  # the echoed prompt carries its logprobs
            params = params.replace(prompt_logprobs=max(self.logprobs, _default(self.prompt_logprobs, 0)))
        return params


# ----- /v1/chat/completions -----------------------------------------------------------------------

class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str  # data:image/...;base64,..., file:// (--allowed-local-media-path) or http(s):// (--allowed-media-domains)
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the model's processor decides the resolution


class ImageContentPart(_Request):
    """An image for a multimodal model (docs/multimodal.md); a text-only model refuses it, naming the part."""

    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Request):
    data: str  # base64
    format: str  # "wav", "mp3" or "flac"; another is refused naming the part


class InputAudioContentPart(_Request):
    """OpenAI's audio input part, for an audio-language model (docs/multimodal.md)."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURL(_Request):
    url: str  # data:audio/...;base64,..., file:// or http(s)://, as image URLs


class AudioURLContentPart(_Request):
    """vLLM's audio part: a clip by URL."""

    type: Literal["audio_url"]
    audio_url: AudioURL


ContentPart = TextContentPart | ImageContentPart | InputAudioContentPart | AudioURLContentPart
_MEDIA_PARTS = (ImageContentPart, InputAudioContentPart, AudioURLContentPart)


class FunctionCallIn(_Request):
    name: str
    arguments: str = ""


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    # OpenAI's roles (developer is rendered as system) or any other the chat template renders, as in vLLM: a template
    # that does not know a role refuses it when rendering.
    role: Annotated[str, Field(min_length=1, examples=["system", "developer", "user", "assistant", "tool"])]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An earlier answer's thinking sent back (what --reasoning-parser answers carry, under either name): the chat
    # template gets it as `reasoning_content`, the name reasoning models' templates read (most drop it from
    # earlier turns).
    reasoning: str | None = Field(default=None, exclude=True)
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs the tool_call_id of the call it answers")
        return self

    @model_validator(mode="after")
    def _reasoning_under_one_name(self) -> ChatMessage:
        if self.reasoning is not None:
            if self.reasoning_content is not None and self.reasoning_content != self.reasoning:
                raise ValueError("reasoning and reasoning_content are two names of one field and differ here; "
                                 "send one of them")
            self.reasoning_content = self.reasoning
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextContentPart))

    @property
    def has_images(self) -> bool:
        """Whether the message has media parts (images or audio)."""
        return isinstance(self.content, list) and any(isinstance(p, _MEDIA_PARTS) for p in self.content)


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_are_a_json_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        """The model is shown this schema and its calls are parsed against it: it must be a valid JSON Schema
        (draft 2020-12) of an object, since arguments are a JSON object."""
        if parameters is None:
            return None
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "the root"
            raise ValueError(f"is not a valid JSON Schema (at {where}: {e.message})") from None
        if parameters.get("type", "object") != "object":
            raise ValueError(f"must describe a JSON object (the call's arguments), not type {parameters['type']!r}")
        return parameters


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's structured_outputs extra-body field: one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None  # kestrel has one backend: nothing to fall back from
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # None: no limit but the context's (vLLM's chat default: the model's remaining length).
    max_tokens: _bounded(Int, "max_tokens") | None = None
    max_completion_tokens: _bounded(Int, "max_tokens", "max_completion_tokens") | None = None
    logprobs: bool | None = False
    top_logprobs: _bounded(Int, "logprobs", "top_logprobs") | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False  # vLLM's: the answer starts with the last message when it is the assistant's
    # vLLM's: false leaves the thinking a --reasoning-parser separates out of the answer
    include_reasoning: bool | None = True
    # OpenAI's; as vLLM does, handed to the chat template (its `reasoning_effort` variable), which decides
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with reasoning_effort among them, when given."""
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is None:
            return kwargs
        given = (kwargs or {}).get("reasoning_effort", self.reasoning_effort)
        if given != self.reasoning_effort:
            _unsupported("reasoning_effort", f"reasoning_effort={self.reasoning_effort!r} and chat_template_kwargs' "
                         f"reasoning_effort={given!r} differ; give one")
        return {**(kwargs or {}), "reasoning_effort": self.reasoning_effort}

    @property
    def tool_choice_mode(self) -> str:
        """'none', 'auto', 'required' or 'named'; 'none' whenever no tools are given."""
        if not self.tools:
            return "none"
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    def message_dicts(self) -> list[dict[str, Any]]:
        return [message.model_dump(exclude_none=True) for message in self.messages]

    def to_sampling_params(self, model_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        self._check_common()
        self._check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            _unsupported("top_logprobs", "top_logprobs needs logprobs set to true")
        check_final_message_continued(self.continue_final_message, self.add_generation_prompt,
                                      self.messages[-1].role)
        logprobs = _default(self.top_logprobs, 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs, model_defaults or {})

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            _unsupported("tools", "tool function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                _unsupported("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not "
                             f"among the tools {names}")
        elif choice == "required" and not names:
            _unsupported("tool_choice", "tool_choice 'required' needs at least one tool in tools")


# ----- /v1/embeddings -------------------------------------------------------------------------------

class PoolingInputRequest(_Request):
    """What every request of a pooled input shares (/v1/embeddings, /pooling, /classify): the input, text or token
    ids, one or many, and vLLM's extensions."""

    model: str | None = None
    input: PromptInput
    user: str | None = None
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None  # vLLM's: keep the input's last N tokens
    add_special_tokens: bool | None = True  # vLLM's
    priority: Int | None = None  # vLLM's: lower first, under --scheduling-policy priority

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: text or token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(p, int) for p in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]


class EmbeddingCompletionRequest(PoolingInputRequest):
    """OpenAI's embeddings request plus vLLM's extensions; the served model pools its final hidden states
    (PoolingParams)."""

    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Annotated[Int, Field(ge=1)] | None = None  # Matryoshka truncation, where the model supports it


class _ChatMessagesRequest(_Request):
    """A request whose input is chat messages the server renders (/tokenize's and /v1/embeddings' chat forms); each
    subclass declares `messages`, `add_generation_prompt` and `continue_final_message` with its own defaults."""

    def check_continuation(self) -> None:
        check_final_message_continued(self.continue_final_message, self.add_generation_prompt,
                                      self.messages[-1].role)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [message.model_dump(exclude_none=True) for message in self.messages]


class EmbeddingChatRequest(_ChatMessagesRequest):
    """vLLM's chat form of /v1/embeddings: the messages, rendered by the chat template, are the one input (no
    generation prompt unless asked: the conversation itself is embedded)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Annotated[Int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    priority: Int | None = None
    add_generation_prompt: bool | None = False
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _by_messages(completion: type, chat: type) -> Any:
    """The completion form or the chat form of a request: a body with messages is the chat form, and its errors are
    then the chat form's alone (each form tagged by its class name, which error locations leave out as they do a
    union member's)."""
    def form(body: Any) -> str:
        return chat.__name__ if isinstance(body, dict) and "messages" in body else completion.__name__

    return Annotated[Annotated[completion, Tag(completion.__name__)] | Annotated[chat, Tag(chat.__name__)],
                     Discriminator(form)]


EmbeddingRequest = _by_messages(EmbeddingCompletionRequest, EmbeddingChatRequest)


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: the little-endian float32 bytes


# ----- /tokenize and /detokenize -------------------------------------------------------------------

class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False  # vLLM's: each token's string (the tokenizer's own piece) too


class TokenizeChatRequest(_ChatMessagesRequest):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = True
    # vLLM's, as on chat completions: the prompt a chat request with them would run
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = False
    # vLLM's: the tokenizer's special tokens (BOS) on top of those the template writes; off, as the template's are
    # usually all a model wants
    add_special_tokens: bool | None = False

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]


TokenizeRequest = _by_messages(TokenizeCompletionRequest, TokenizeChatRequest)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


# ----- responses ------------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prefix cache served


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # with --reasoning-parser: the answers' tokens up to the end of their thinking


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details, as in vLLM
    # A kestrel extension: with prompt_compression, the prompt tokens before compression (prompt_tokens counts
    # the compressed prompt); left out of the body otherwise.
    original_prompt_tokens: int | None = None
    # With --reasoning-parser (chat answers): their reasoning tokens; left out otherwise.
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _without_unasked_extension(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in ("original_prompt_tokens", "completion_tokens_details"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ListResponse(BaseModel):
    """The envelope of the pooling endpoints' answers (vLLM's): each subclass adds its `data` list."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class EmbeddingResponse(ListResponse):
    data: list[EmbeddingData]


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's logprob object, keyed by token id in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class _StreamedChoice(BaseModel):
    """A choice that streamed chunks carry: its `ALWAYS_SENT` fields are written as null until they have a value,
    as OpenAI's chunks (and vLLM's) carry them, though a chunk is otherwise written without its null fields."""

    ALWAYS_SENT: ClassVar[tuple[str, ...]] = ("logprobs", "finish_reason")

    @model_serializer(mode="wrap")
    def _with_null_finish(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self.ALWAYS_SENT:
            data.setdefault(name, None)
        return data


class CompletionChoice(_StreamedChoice):
    ALWAYS_SENT: ClassVar[tuple[str, ...]] = ("logprobs", "finish_reason", "stop_reason")  # vLLM's completion chunks

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None  # sent as null, as vLLM and OpenAI's schema have it
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # OpenAI's message fields this server never fills, sent as null as vLLM sends them
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None
    # [] when there are none, as vLLM sends it (clients iterate over it)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # With --reasoning-parser: the model's thinking (vLLM's `reasoning`, and `reasoning_content`, its older name
    # that clients still read); null otherwise, as vLLM sends them.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser (ChatResponseMessage's two fields)
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_StreamedChoice):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelPermission(BaseModel):
    """vLLM's permission entry of a model card: what a client may do with the served model here."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kestrel"
    root: str | None = None
    parent: str | None = None  # a fine-tune's base model: none here (no LoRA adapters are served)
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ----- errors ----------------------------------------------------------------------------------------

_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "input": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a non-empty string or a list of non-empty strings",
    "content": "a string or a list of {'type': 'text', 'text': ...}, {'type': 'image_url', 'image_url': "
               "{'url': ...}} and {'type': 'input_audio', 'input_audio': {'data': ..., 'format': ...}} parts",
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
}


def validation_error_info(errors: list[dict[str, Any]],
                          hints: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(param, message) for the first of pydantic's errors, in the words a client can act on; `hints`: what a
    route's union fields take, where they differ from `_UNION_HINTS` (the Responses API's `input`)."""
    union_hints = {**_UNION_HINTS, **(hints or {})}
    if not errors:
        return None, "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg"))
        return None, f"the request body is not valid JSON: {detail}"
    unknown = _unknown_field(errors)
    if unknown is not None:
        loc = _field_loc(unknown)
        name, param = str(loc[-1]), _path(loc)
        reason = NOT_SUPPORTED_FIELDS.get(name)
        if reason is not None:
            return param, f"{param} is not supported: {reason}; remove it from the request"
        return param, (f"unknown field {param}: it is not a request field this server knows (OpenAI's and vLLM's "
                       "are listed at /docs); remove it or check its spelling")
    # A field that only another shape of a union body knows says nothing about what is wrong here.
    errors = [e for e in errors if e.get("type") != "extra_forbidden"] or errors
    first = errors[0]
    loc = _field_loc(first)
    if not loc:
        return None, f"the request body must be a JSON object ({first.get('msg')})"
    param = _path(loc)
    if first.get("type") == _BOUND_ERROR:  # SamplingParams' message, which names the field
        return param, first["msg"]
    for error in errors:
        error_loc = _field_loc(error)
        if (error.get("type") == "literal_error" and error_loc[-1:] == ["type"] and "content" in error_loc
                and error_loc[:len(loc)] == loc):
            return param, (f"invalid {param}: content parts of type {error.get('input')!r} are not supported; "
                           "use {'type': 'text', 'text': ...} or, for a multimodal model, {'type': 'image_url', "
                           "'image_url': {'url': ...}} or {'type': 'input_audio', 'input_audio': {...}}")
    same_field = [e for e in errors if _field_loc(e)[:len(loc)] == loc]
    name = next((part for part in reversed(loc) if isinstance(part, str)), "")
    if len(same_field) > 1 and name in union_hints:
        # When only one accepted shape got past the top level (e.g. a list), its error is the useful one.
        deeper = [e for e in same_field if len(_field_loc(e)) > len(loc)]
        if deeper and len({_union_member(e, loc) for e in deeper}) == 1:
            return _path(_field_loc(deeper[0])), f"invalid {_path(_field_loc(deeper[0]))}: {deeper[0].get('msg')}"
        return param, f"invalid {param}: expected {union_hints[name]}"
    return param, f"invalid {param}: {first.get('msg')}"


def _unknown_field(errors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first unknown-field error, for a field that every shape of a union body (e.g. /tokenize's prompt or
    messages forms) rejects: a field that one shape knows is no unknown field."""
    members = {_union_member(e) for e in errors}
    extra = [e for e in errors if e.get("type") == "extra_forbidden" and _field_loc(e)]
    for error in extra:
        loc = _field_loc(error)
        if all(any(_field_loc(e) == loc and _union_member(e) == m for e in extra) for m in members):
            return error
    return None


def _union_member(error: dict[str, Any], field: list[Any] | None = None) -> str:
    """The union member an error is about: the body's (the first tag), or with `field` (a location without tags)
    the member of that field's own union (the first tag after the field)."""
    matched = 0
    for part in error.get("loc", ()):
        if _is_union_tag(part):
            if field is None or matched == len(field):
                return part
        elif field is not None and matched < len(field) and part == field[matched]:
            matched += 1
    return ""


def _field_loc(error: dict[str, Any]) -> list[Any]:
    """The error's location without 'body' and without pydantic's union-member tags."""
    return [part for part in error.get("loc", ()) if part != "body" and not _is_union_tag(part)]


def _is_union_tag(part: Any) -> bool:
    if not isinstance(part, str):
        return False
    return ("[" in part or "'" in part or part[:1].isupper() or part.split("-")[0] in _TYPE_TAGS
            or part.startswith(("function-", "constrained-")))


def parse_model(model: type[BaseModel], data: Any) -> BaseModel:
    """Validate already-decoded JSON; raise InvalidRequestError naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        param, message = validation_error_info(e.errors(include_url=False))
        raise InvalidRequestError(param or "body", message) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _path(loc: list[Any]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _schema(param: str, value: dict[str, Any] | str) -> dict[str, Any] | str:
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError as error:
            _unsupported(param, f"{param} must be a JSON schema (an object or its JSON text): {error}")
        except RecursionError:
            _unsupported(param, f"{param} nests too deeply to be a JSON schema")
    return value


def _structured(param: str, **spec: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**spec)
    except SamplingParamsError as error:
        raise InvalidRequestError(param, str(error)) from None


def _beam_search_ignores(name: str, value: Any, request_default: Any) -> bool:
    """A value that asks for nothing: unset, empty, false, or the request's or SamplingParams' default."""
    if value is False or value in _EMPTY_VALUES:
        return True
    defaults = [request_default, getattr(SamplingParams, name, None)]
    return any(type(value) is type(d) and value == d for d in defaults if d is not None)


def _unsupported(param: str, message: str) -> None:
    raise InvalidRequestError(param, message)


# Request fields that are SamplingParams fields of the same name and meaning, passed on when set.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
                    "spaces_between_special_tokens", "include_stop_str_in_output")
# Request fields that are BeamSearchParams fields of the same name, passed on when set.
_BEAM_SEARCH_SETTINGS = ("ignore_eos", "temperature", "length_penalty", "include_stop_str_in_output")


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value
