"""Request: the engine's record of one sequence (pure Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kestrel.outputs import Logprob
from kestrel.pooling_params import PoolingParams
from kestrel.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request cannot be served as given; `param` names the offending input, `code` is the error body's code."""

    code = "invalid_value"

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses process boundaries (tokenizer workers)
        return type(self), (self.param, str(self))


def prompt_too_long(num_tokens: int, max_model_len: int, param: str = "prompt",
                    generates: bool = True) -> InvalidRequestError:
    """`generates`: the request generates (its prompt must leave room for a token), else it pools its prompt."""
    if not generates:
        return InvalidRequestError(param, f"the prompt has {num_tokens} tokens but the model's context is "
                                   f"max_model_len={max_model_len}; shorten it to at most {max_model_len} tokens")
    return InvalidRequestError(
        param, f"the prompt has {num_tokens} tokens but the model's context is max_model_len={max_model_len}, "
        f"which must also fit at least one generated token; shorten the prompt to at most {max_model_len - 1} tokens")


def truncation_size(truncate: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens truncate_prompt_tokens keeps (vLLM's: -1 is max_model_len); None: all."""
    if truncate is None:
        return None
    if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate == 0 or truncate < -1:
        raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens={truncate!r}: give an integer "
                                  f"from 1 to max_model_len={max_model_len}, or -1 for max_model_len")
    if truncate > max_model_len:
        raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens={truncate} is more than "
                                  f"max_model_len={max_model_len}; give at most {max_model_len}, or -1 for "
                                  "max_model_len")
    return max_model_len if truncate == -1 else truncate


def truncate_prompt(text: str | None, token_ids: list[int], truncate: int | None, max_model_len: int,
                    has_media: bool = False) -> tuple[str | None, list[int]]:
    """A prompt cut to its last `truncate` tokens (`truncation_size`), with its text where nothing was cut (a cut
    prompt's text is no longer the prompt). A prompt with media is not cut: its placeholders would be."""
    keep = truncation_size(truncate, max_model_len)
    if keep is None or len(token_ids) <= keep:
        return text, token_ids
    if has_media:
        raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens={truncate} would cut a prompt "
                                  f"of {len(token_ids)} tokens that holds images or audio (their placeholders "
                                  "with it); leave truncate_prompt_tokens out or send a shorter prompt")
    return None, token_ids[-keep:]


@dataclass(frozen=True)
class MediaItem:
    """One image (or other media) of a prompt, as the engine sees it: its modality, a hash of its content (the
    encoder cache's key, and part of the prefix-cache hash of every block its placeholders touch), and where its
    embeddings go in the prompt: `ranges`, (start, length) runs of positions filled in order by the encoder's output
    rows. `data` is the processor's output (tensors), opaque to the engine and read only by the worker's model.
    `bidirectional`: each run's positions attend to the whole run (Gemma 3's images), so the scheduler computes a
    run within one step and the runner widens its rows' causal ends; the engine sets it from the model."""

    modality: str
    content_hash: str
    ranges: tuple[tuple[int, int], ...]
    data: Any = field(default=None, compare=False, repr=False)
    bidirectional: bool = False

    @property
    def num_embeds(self) -> int:
        return sum(length for _, length in self.ranges)

    @property
    def start(self) -> int:
        return self.ranges[0][0]

    @property
    def end(self) -> int:
        """One past the item's last placeholder position."""
        start, length = self.ranges[-1]
        return start + length

    def overlaps(self, start: int, end: int) -> bool:
        return any(s < end and start < s + n for s, n in self.ranges)


def end_outside_runs(media: tuple[MediaItem, ...], start: int, end: int) -> int:
    """The furthest end <= `end` of a step computing positions `start..end` that cuts no bidirectional run: a run
    the step would end inside is left for a later step whole, or, when the step starts inside it (or at its start,
    with no room for it), the step computes nothing (`start` is returned)."""
    for item in media:
        if not item.bidirectional:
            continue
        for run_start, length in item.ranges:
            if run_start < end < run_start + length:
                end = run_start if run_start > start else start
    return end


def check_media(media: tuple[MediaItem, ...], num_prompt_tokens: int) -> None:
    """A request's media items must name non-empty, ordered, non-overlapping placeholder runs inside its prompt."""
    previous_end = 0
    for index, item in enumerate(media):
        param = f"multi_modal_data[{index}]"
        if not isinstance(item, MediaItem):
            raise InvalidRequestError(param, f"expected a MediaItem, got {type(item).__name__}")
        if not item.ranges or not isinstance(item.content_hash, str) or not item.content_hash:
            raise InvalidRequestError(param, "a media item needs a content hash and at least one placeholder range")
        for start, length in item.ranges:
            if isinstance(start, bool) or not isinstance(start, int) or not isinstance(length, int) or length < 1:
                raise InvalidRequestError(param, f"placeholder range ({start!r}, {length!r}) is not (start >= 0, "
                                          "length >= 1)")
            if start < previous_end or start + length > num_prompt_tokens:
                raise InvalidRequestError(param, f"placeholder range ({start}, {length}) overlaps an earlier one or "
                                          f"runs past the prompt's {num_prompt_tokens} tokens")
            previous_end = start + length


class RequestStatus(enum.IntEnum):
    """Where a request stands; `finished` and `finish_reason` are plain attributes of each member (read several
    times per request and step, where a property would cost a Python frame each time)."""

    finished: bool
    finish_reason: str | None

    def __new__(cls, value: int, finish_reason: str | None = None) -> RequestStatus:
        member = int.__new__(cls, value)
        member._value_ = value
        member.finish_reason = finish_reason
        member.finished = finish_reason is not None
        return member

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3, "stop"
    FINISHED_LENGTH = 4, "length"
    FINISHED_ABORTED = 5, "abort"


@dataclass
class Request:
    """One sequence. `num_computed_tokens` catches up with `num_tokens` one scheduled chunk at a time."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_model_len: int | None = None
    extra_eos_token_ids: frozenset[int] = frozenset()  # generation_config.json's, besides the tokenizer's
    priority: int = 0  # under the priority policy: lower values are scheduled first
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # (token ids, logprobs) of the top candidates per sampled token, when logprobs were asked for.
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Attention sinks + window (streaming_window): tokens dropped out of the window, in whole blocks, right after
    # the sink blocks. The KV cache holds the other tokens, and `num_computed_tokens` counts among those.
    num_dropped_tokens: int = 0
    # Tokens already scheduled to be sampled whose ids the host does not know yet (async scheduling: at most
    # the one of the step in flight once the step before it is collected).
    num_pending_tokens: int = 0
    # Speculative decoding: tokens proposed for this request's next step (verified there, then cleared).
    spec_token_ids: list[int] = field(default_factory=list)
    # Chained hashes of the request's full blocks, kept across preemption so resumption hits the cache.
    block_hashes: list = field(default_factory=list)
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # A pooling request: its prompt's pooled final hidden state, set by the step that completes the prompt.
    pooling_params: PoolingParams | None = None
    pooled_output: list[float] | None = None
    # Images (media) of the prompt, ordered by position: their placeholder tokens take the encoder's embeddings.
    media: tuple[MediaItem, ...] = ()
    # vLLM's cache_salt: part of the first block's hash, so only requests with the same salt share cached blocks.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        # Read for every sampled token, so plain attributes fixed here rather than properties.
        # Output tokens allowed: the request's own limit, capped by the model's context.
        self.max_tokens: int = self._output_limit()
        # The EOS ids whose sampling ends the request (past min_tokens): the tokenizer's and generation_config.json's,
        # none under ignore_eos.
        eos = set() if self.sampling_params.ignore_eos else self.extra_eos_token_ids | {self.eos_token_id}
        self.ending_eos_ids: frozenset[int] = frozenset(eos - {None})
        # Every id whose sampling can end the request past min_tokens: its ending EOS ids and stop_token_ids.
        self.stopping_ids: frozenset[int] = self.ending_eos_ids | frozenset(self.sampling_params.stop_token_ids or ())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_kv_tokens(self) -> int:
        """The tokens the KV cache holds once computed: all but those dropped out of a streaming window."""
        return len(self.all_token_ids) - self.num_dropped_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def _output_limit(self) -> int:
        limit = self.sampling_params.max_tokens
        room = (self.max_model_len - self.num_prompt_tokens) if self.max_model_len else None
        if limit is None:
            return room if room is not None else 1 << 62
        return limit if room is None else min(limit, room)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def priority_key(self) -> tuple[int, float]:
        return self.priority, self.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.status.finished
