"""Beam search over the engine's one-token steps (vLLM's `LLM.beam_search` and `use_beam_search`).

Each round every live beam is one engine request for a single token with the 2 x beam_width most likely
candidates (their logprobs, before any sampling transform); prefix caching serves each beam's shared prefix
from the KV cache, so a round computes little more than one token per beam. A beam that produces EOS is
complete; the others are extended by their candidates and the beam_width best by cumulative logprob live on.
The result ranks complete and live beams by cum_logprob / length ** length_penalty (vLLM's score, where the
length counts the prompt and leaves a final EOS out).

`BeamSearch` holds the state and knows nothing of how a round runs: `LLM` runs its rounds synchronously,
the server through the async engine.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kestrel.entrypoints.async_engine import submit_all
from kestrel.outputs import Logprob
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """A beam: `tokens` holds the prompt and the generated tokens (vLLM's shape)."""

    tokens: list[int]
    num_prompt_tokens: int
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    length = len(beam.tokens)
    if beam.tokens and beam.tokens[-1] in eos_token_ids:
        length -= 1
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """The beams of one prompt, advanced one round at a time."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        # The engine needs room for one more token after each beam's last.
        self.max_tokens = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        self.live = [BeamSearchSequence(list(prompt_token_ids), len(prompt_token_ids))]
        self.complete: list[BeamSearchSequence] = []
        self.rounds = 0

    @property
    def done(self) -> bool:
        return not self.live or self.rounds >= self.max_tokens

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """One round: `candidates[i]` are the next-token candidates of live beam i."""
        width = self.params.beam_width
        extended: list[BeamSearchSequence] = []
        for beam, options in zip(self.live, candidates, strict=True):
            for token_id, logprob in options.items():
                child = BeamSearchSequence(beam.tokens + [token_id], beam.num_prompt_tokens,
                                           beam.logprobs + [options], beam.cum_logprob + logprob.logprob)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    child.finish_reason = "stop"
                    self.complete.append(child)
                else:
                    extended.append(child)
        self.rounds += 1
        extended.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.live = extended[:width]
        # Complete beams rank by their final score, so the best beam_width of them by it are all that can win.
        self.complete.sort(key=lambda b: beam_score(b, self.eos_token_ids, self.params.length_penalty),
                           reverse=True)
        del self.complete[width:]

    def result(self) -> BeamSearchOutput:
        for beam in self.live:
            beam.finish_reason = "length"
        ranked = sorted(self.complete + self.live, reverse=True,
                        key=lambda b: beam_score(b, self.eos_token_ids, self.params.length_penalty))
        return BeamSearchOutput(ranked[: self.params.beam_width])


    def finish(self, tokenizer: Any) -> BeamSearchOutput:
        """The ranked beams with their texts (a final EOS's text only with include_stop_str_in_output)."""
        output = self.result()
        for beam in output.sequences:
            tokens = beam.output_token_ids
            if beam.finish_reason == "stop":
                beam.stop_reason = None
                if not self.params.include_stop_str_in_output:
                    tokens = tokens[:-1]
            beam.text = tokenizer.decode(tokens, skip_special_tokens=not self.params.include_stop_str_in_output)
        return output


Round = list[tuple[BeamSearch, BeamSearchSequence]]


def next_round(searches: list[BeamSearch]) -> Round:
    """The live beams of every unfinished search: one engine request each this round (empty: all done)."""
    return [(search, beam) for search in searches if not search.done for beam in search.live]


def advance_round(beams: Round, candidates: list[dict[int, Logprob]]) -> None:
    """Give each search its beams' candidates, `candidates[i]` being those of `beams[i]`."""
    per_search: dict[int, list[dict[int, Logprob]]] = {}
    owners: dict[int, BeamSearch] = {}
    for (search, _), options in zip(beams, candidates, strict=True):
        per_search.setdefault(id(search), []).append(options)
        owners[id(search)] = search
    for key, options in per_search.items():
        owners[key].advance(options)


def check_beam_width(params: BeamSearchParams, max_logprobs: int, param: str = "beam_width") -> None:
    """Each round asks the engine for 2 x beam_width logprobs, which max_logprobs bounds."""
    if max_logprobs >= 0 and 2 * params.beam_width > max_logprobs:
        raise InvalidRequestError(param, f"beam search with {param}={params.beam_width} needs 2 x "
                                  f"{params.beam_width} candidates per beam, more than this engine's max_logprobs="
                                  f"{max_logprobs}; use {param} <= {max_logprobs // 2} or a larger max_logprobs")


async def search_async(engine: Any, prompts: list[list[int]], params: BeamSearchParams,
                       priority: int = 0) -> list[BeamSearchOutput]:
    """Beam search on an AsyncEngine: each round's beams run as concurrent one-token requests."""
    check_beam_width(params, engine.core.config.model.max_logprobs, "n")
    searches = [BeamSearch(ids, params, engine.eos_token_ids, engine.max_model_len) for ids in prompts]
    step = params.step_params()
    # The server's request timeout bounds the whole search, not each round's one-token requests.
    timeout_s = getattr(engine, "request_timeout_s", None)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while beams := next_round(searches):
        engine.check_capacity(len(beams))
        rest = {"params": step, "priority": priority,
                "timeout_s": None if deadline is None else max(deadline - time.monotonic(), 0.0)}
        streams = submit_all(engine, [(f"beam-{uuid.uuid4().hex}", beam.tokens, rest) for _, beam in beams])
        try:
            finals = [await _final(stream) for stream in streams]
        finally:
            for stream in streams:
                await stream.aclose()
        advance_round(beams, [final.outputs[0].logprobs[0] for final in finals])
    return [search.finish(engine.tokenizer) for search in searches]


async def _final(stream: Any) -> Any:
    final = None
    async for output in stream:
        final = output
    if final is None or not final.outputs or not final.outputs[0].logprobs:
        raise RuntimeError("a beam search step ended without its token's candidates")
    return final
