"""The API server's half of a request whose engine core runs in its own process: it fans a request with n > 1
out into n sequences (the core sees only n = 1), turns each step's new token ids into text and stop strings,
names the logprobs' tokens, and gathers the sequences back into the RequestOutputs the in-process engine gives.

A stop string ends a sequence here: `update` says which sequences to abort in the core; tokens the core sampled
for them meanwhile are dropped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kestrel.engine.detokenizer import IncrementalDetokenizer, TokenizerLookups
from kestrel.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SequenceDelta, delta_completion
from kestrel.pooling_params import PoolingParams
from kestrel.sampling_params import SamplingParams, sibling_seed


def child_params(params: SamplingParams | PoolingParams) -> list[tuple[int, SamplingParams | PoolingParams]]:
    """(index, params) of each sequence of a request, as the in-process engine fans out n > 1 (distinct seeds keep
    seeded siblings apart). The core gets each sequence's output_kind: a final-only request with stop strings is
    streamed, so that its stop strings end it as they appear."""
    if isinstance(params, PoolingParams):
        return [(0, params)]
    if params.final_only and params.stop:
        params = params.replace(output_kind="cumulative")
    if params.n == 1:
        return [(0, params)]
    return [(i, params.replace(n=1, seed=sibling_seed(params.seed, i))) for i in range(params.n)]


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class _Sequence:
    index: int
    request_id: str
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    num_emitted: int = 0
    finish_emitted: bool = False  # output_kind="delta": its finish has been handed out
    logprob_sum: float = 0.0  # output_kind="delta": the sampled tokens' logprobs emitted so far, summed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ClientRequest:
    """One request's outputs, rebuilt from its sequences' deltas."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams | PoolingParams, tokenizer: Any,
                 token_text: Callable[[int], str | None]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self._sampling = params if isinstance(params, SamplingParams) else None
        self._token_text = token_text
        n = params.n
        self.sequences: dict[str, _Sequence] = {}
        for index, _ in child_params(params):
            detokenizer = None
            if self._sampling is not None and self._sampling.detokenize:
                detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, self._sampling.replace(n=1),
                                                     TokenizerLookups.of(tokenizer))
            rid = child_id(request_id, index, n)
            self.sequences[rid] = _Sequence(index, rid, detokenizer)
        self._ordered = sorted(self.sequences.values(), key=lambda s: s.index)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._prompt_logprobs_emitted = False  # output_kind="delta": they went out with an earlier output
        self.num_cached_tokens = 0
        self.pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        ordered = self._ordered
        if len(ordered) == 1:
            return ordered[0].finish_reason is not None
        return all(s.finished for s in ordered)

    def aborted(self) -> RequestOutput | None:
        """The final output of a request its client aborted: each sequence still going ends with finish_reason
        "abort", its text brought up to its tokens (a final-only request's is otherwise made at its end)."""
        for seq in self._ordered:
            if seq.finished:
                continue
            detokenizer = seq.detokenizer
            if detokenizer is not None and not detokenizer.stopped:
                detokenizer.update(seq.token_ids[len(detokenizer.token_ids):])
            seq.finish_reason, seq.stop_reason = "abort", None
        return self.output()

    def apply(self, delta: SequenceDelta) -> bool:
        """Take one sequence's step; True when a stop string ended it here (the core must abort it)."""
        seq = self.sequences.get(delta.request_id)
        if seq is None or seq.finished:
            return False  # sampled for a sequence a stop string already ended
        params = self._sampling
        seq.token_ids += delta.new_token_ids
        if delta.new_logprobs is not None:
            seq.logprobs += [self._named(entry) for entry in delta.new_logprobs]
        if delta.metrics is not None:
            seq.metrics = delta.metrics
        # The prompt's logprobs are every sequence's (one prompt): from the first to bring them, so that the first
        # output carries them whichever sequence it comes from (a delta output carries them only once).
        if delta.prompt_logprobs is not None and (seq.index == 0 or self.prompt_logprobs is None):
            self.prompt_logprobs = [self._named(entry) for entry in delta.prompt_logprobs]
        if seq.index == 0:
            self.num_cached_tokens = max(delta.num_cached_tokens, 0)
            if delta.pooled is not None:
                self.pooled = delta.pooled
        stopped = False
        # Final-only requests without stop strings need their text only once, at the end.
        detokenizer = seq.detokenizer
        if detokenizer is not None and (not params.final_only or params.stop or delta.finish_reason is not None):
            # Stopped by its last token (EOS, a stop token id, a grammar's end): its text is left out by default.
            stop_token = delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str)
            stop_string = detokenizer.update(seq.token_ids[len(detokenizer.token_ids):], stop_token)
            if stop_string is not None and delta.finish_reason is None:
                seq.finish_reason, seq.stop_reason, stopped = "stop", stop_string, True
                if seq.metrics is not None:
                    seq.metrics = dataclasses.replace(seq.metrics, finished_time=time.monotonic())
        if delta.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
        return stopped

    def _named(self, entry: dict[int, Logprob] | None) -> dict[int, Logprob] | None:
        if entry is None or (self._sampling is not None and not self._sampling.detokenize):
            return entry
        return {t: dataclasses.replace(lp, decoded_token=self._token_text(t)) for t, lp in entry.items()}

    def output(self) -> RequestOutput | None:
        """The request's output after the deltas applied since the last one (None: a final-only request that has
        not finished)."""
        finished = self.finished
        params = self._sampling
        if params is not None and params.final_only and not finished:
            return None
        first = self._ordered[0]
        m = first.metrics
        metrics = None
        if m is not None and len(self._ordered) == 1 and (m.finished_time is not None) == finished:
            metrics = m  # one sequence's own metrics are the request's (replaced on change, never changed in place)
        elif m is not None:
            finished_times = [s.metrics.finished_time or 0.0 for s in self._ordered if s.metrics is not None]
            metrics = RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                     max(finished_times, default=0.0) if finished else None,
                                     sum(s.metrics.num_preemptions for s in self._ordered if s.metrics is not None))
        prompt_logprobs = None
        if params is not None and params.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs or []
        if params is not None and params.delta_outputs:
            # Only the sequences that gained tokens or ended since the last output, each with only that; the
            # prompt's logprobs once, with the first output.
            completions = [self._delta_completion(s) for s in self._ordered
                           if s.num_emitted < len(s.token_ids) or (s.finished and not s.finish_emitted)]
            if prompt_logprobs is not None:
                prompt_logprobs, self._prompt_logprobs_emitted = (
                    None if self._prompt_logprobs_emitted else prompt_logprobs), True
        else:
            completions = [self._completion(s) for s in self._ordered]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=metrics,
            pooled=self.pooled,
        )

    def _completion(self, seq: _Sequence) -> CompletionOutput:
        wants_logprobs = self._sampling is not None and self._sampling.logprobs is not None
        start, seq.num_emitted = seq.num_emitted, len(seq.token_ids)
        detokenizer = seq.detokenizer
        text, delta_text = detokenizer.text_and_delta(seq.finished) if detokenizer is not None else ("", "")
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(seq.token_ids),
            logprobs=list(seq.logprobs) if wants_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=delta_text,
            delta_token_ids=seq.token_ids[start:],
            delta_logprobs=seq.logprobs[start:] if wants_logprobs else None,
        )

    def _delta_completion(self, seq: _Sequence) -> CompletionOutput:
        start, seq.num_emitted = seq.num_emitted, len(seq.token_ids)
        seq.finish_emitted = seq.finished
        wants_logprobs = self._sampling is not None and self._sampling.logprobs is not None
        detokenizer = seq.detokenizer
        out = delta_completion(seq.index, seq.token_ids, seq.logprobs if wants_logprobs else None, start,
                               detokenizer.get_delta(seq.finished) if detokenizer is not None else "",
                               seq.finish_reason, seq.stop_reason, seq.logprob_sum)
        seq.logprob_sum = out.logprob_sum or 0.0
        return out
