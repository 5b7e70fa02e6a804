"""The messages between the API server and an engine core in its own process: msgpack over a pipe, plain data only
(token ids, numbers, strings; never pickled objects), so a message costs what its tokens cost.

Client -> core: START (the EOS id), ADD (one sequence: request id, prompt ids, sampling or pooling params as a dict,
priority, the grammar's source, the cache salt), ABORT (request ids), TOKENIZER_INFO, SHUTDOWN. Core -> client: READY
(what the server needs to know of the model), ERROR (a start-up or step failure: the exception's class name and
message), STEP (the sequences taken and refused since the last message, each advanced sequence's new tokens, the
engine's stats, and the sequences whose abort was applied since the last message).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from kestrel.config import ConfigError
from kestrel.outputs import Logprob, RequestMetrics, SequenceDelta
from kestrel.pooling_params import PoolingParams
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams, ThinkingTags

ADD, ABORT, SHUTDOWN = "add", "abort", "shutdown"
# The tokenizer's EOS id, sent while the core imports: the core loads no tokenizer.
START = "start"
# The vocabulary as xgrammar reads it (TokenizerInfo.serialize_json), sent before the first grammar: the core
# loads no tokenizer.
TOKENIZER_INFO = "tokenizer_info"
READY, ERROR, STEP = "ready", "error", "step"
# Internal to the core process: a grammar compiled in its compile thread (never crosses the pipe).
COMPILED = "compiled"


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(payload: bytes) -> list[Any]:
    # Token ids are map keys (logprobs, logit_bias).
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


# ----- requests ---------------------------------------------------------------------------------------------

def params_to_wire(params: SamplingParams | PoolingParams) -> list[Any]:
    if isinstance(params, PoolingParams):
        return ["pooling", {"normalize": params.normalize, "dimensions": params.dimensions,
                            "pooling_type": params.pooling_type}]
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    spec = params.structured_outputs
    if spec is not None:
        fields["structured_outputs"] = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        if spec.after_thinking is not None:
            fields["structured_outputs"]["after_thinking"] = dataclasses.astuple(spec.after_thinking)
    return ["sampling", fields]


def params_from_wire(wire: list[Any]) -> SamplingParams | PoolingParams:
    kind, fields = wire[0], dict(wire[1])
    if kind == "pooling":
        return PoolingParams(**fields)
    spec = fields.get("structured_outputs")
    if spec is not None:
        tags = spec.get("after_thinking")
        if tags is not None:
            spec = {**spec, "after_thinking": ThinkingTags(*tags)}
        fields["structured_outputs"] = StructuredOutputsParams(**spec)
    return SamplingParams(**fields)


# ----- errors -----------------------------------------------------------------------------------------------

def error_to_wire(error: BaseException) -> list[Any]:
    """[class name, message, param, code] of a refusal or a failure."""
    return [type(error).__name__, str(error), getattr(error, "param", None), getattr(error, "code", None)]


def refusal_from_wire(wire: list[Any]) -> ValueError:
    """A request's refusal as the in-process engine raises it (an InvalidRequestError keeps its param and code)."""
    name, message, param, code = wire
    if name == "SamplingParamsError":
        return SamplingParamsError(param, message)
    if code is None:
        return ValueError(message)
    error = InvalidRequestError(param, message)
    error.code = code
    return error


def startup_error_from_wire(wire: list[Any]) -> Exception:
    """A core that could not start fails `kestrel serve` as the in-process engine does: a ConfigError (the CLI's
    clean message) for a bad setting, else a RuntimeError naming the failure."""
    name, message = wire[0], wire[1]
    if name in ("ConfigError", "CheckpointError", "ValueError", "SamplingParamsError"):
        return ConfigError(message)
    return RuntimeError(f"the engine core process failed to start: {name}: {message}")


# ----- outputs ----------------------------------------------------------------------------------------------

def _logprobs_to_wire(entries: list[dict[int, Logprob] | None] | None) -> list[Any] | None:
    if entries is None:
        return None
    return [None if e is None else {t: [lp.logprob, lp.rank] for t, lp in e.items()} for e in entries]


def logprobs_from_wire(wire: list[Any] | None) -> list[dict[int, Logprob] | None] | None:
    if wire is None:
        return None
    return [None if e is None else {t: Logprob(v[0], v[1]) for t, v in e.items()} for e in wire]


def delta_to_wire(delta: SequenceDelta, send_prompt_logprobs: bool) -> list[Any]:
    """A core's SequenceDelta as a compact record; its prompt logprobs only when `send_prompt_logprobs`."""
    rid, tokens, logprobs, finish, stop, cached, prompt, m, pooled = delta
    if m is None and logprobs is None and not send_prompt_logprobs:  # a plain decode step's record
        return [rid, tokens, None, finish, stop, cached, None, None, pooled]
    metrics = None if m is None else [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
                                      m.num_preemptions]
    prompt_logprobs = _logprobs_to_wire(prompt) if send_prompt_logprobs else None
    return [rid, tokens, _logprobs_to_wire(logprobs), finish, stop, cached, prompt_logprobs, metrics, pooled]


def delta_from_wire(wire: list[Any]) -> SequenceDelta:
    rid, tokens, logprobs, finish, stop, cached, prompt_logprobs, metrics, pooled = wire
    if logprobs is None and prompt_logprobs is None and metrics is None:  # a plain decode step's record
        return SequenceDelta(rid, tokens, None, finish, stop, cached, None, None, pooled)
    return SequenceDelta(rid, tokens, logprobs_from_wire(logprobs), finish, stop, cached,
                         logprobs_from_wire(prompt_logprobs), None if metrics is None else RequestMetrics(*metrics),
                         pooled)
