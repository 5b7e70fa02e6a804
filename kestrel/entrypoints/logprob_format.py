"""Logprobs as the responses carry them: completions' parallel lists, chat's objects and vLLM's prompt_logprobs.

The engine hands over {token_id: Logprob} per token, the chosen token first, then the top candidates by rank.
A token is labelled by its text, or as "token_id:N" when the request asks for return_tokens_as_token_ids
(vLLM's spelling, for tokens whose text alone is not valid UTF-8); text offsets follow the labels, as vLLM's do.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kestrel.entrypoints.protocol import (
    ChatLogProb,
    ChatLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
)
from kestrel.outputs import Logprob

MIN_LOGPROB = -9999.0  # JSON has no -inf

TokenLogprobs = list[dict[int, Logprob] | None]


def finite(logprob: float | None) -> float:
    if logprob is None or math.isnan(logprob):
        return MIN_LOGPROB
    return max(logprob, MIN_LOGPROB)


def join(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


def text_end(logprobs: CompletionLogProbs) -> int:
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1]) if logprobs.tokens else 0


class LogprobFormatter:
    """One request's view: how many top candidates it asked for and how its tokens are labelled."""

    def __init__(self, token_text: Callable[[int], str | None], num_top: int | None,
                 tokens_as_ids: bool = False, token_bytes: Callable[[int], bytes] | None = None) -> None:
        """`token_bytes`: the bytes a token stands for (chat's `bytes`, which rebuild a character split across
        tokens, whose text alone is U+FFFD); without it, the UTF-8 of its label."""
        self._token_text = token_text
        self._token_bytes = token_bytes
        self.num_top = num_top or 0
        self.tokens_as_ids = tokens_as_ids

    def label(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else self._token_text(token_id) or ""

    def _top(self, candidates: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
        """The request's top candidates, most likely first (the engine may hold more, e.g. for prompt_logprobs)."""
        ranked = sorted(candidates.items(), key=lambda item: -item[1].logprob)
        return [(t, lp) for t, lp in ranked if lp.rank is None or lp.rank <= self.num_top][: self.num_top]

    def completion(self, token_ids: list[int], logprobs: TokenLogprobs | None, offset: int) -> CompletionLogProbs:
        """/v1/completions' parallel lists; the chosen token appears among its top candidates too."""
        result = CompletionLogProbs()
        for token_id, candidates in zip(token_ids, logprobs or []):
            text = self.label(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if candidates is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            chosen = candidates.get(token_id)
            result.token_logprobs.append(finite(chosen.logprob if chosen else None))
            top = {self.label(t): finite(lp.logprob) for t, lp in self._top(candidates)}
            if chosen is not None:
                top.setdefault(text, finite(chosen.logprob))
            result.top_logprobs.append(top)
        return result

    def echoed_prompt(self, token_ids: list[int], logprobs: TokenLogprobs | None) -> CompletionLogProbs:
        """The echoed prompt's tokens with their logprobs (None for the first token, which has no context)."""
        entries = list(logprobs or [])
        entries += [None] * (len(token_ids) - len(entries))
        return self.completion(token_ids, entries, 0)

    def chat(self, token_ids: list[int], logprobs: TokenLogprobs | None) -> list[ChatLogProbsContent]:
        content = []
        for token_id, candidates in zip(token_ids, logprobs or []):
            candidates = candidates or {}
            chosen = candidates.get(token_id)
            content.append(ChatLogProbsContent(
                **self._chat_logprob(token_id, chosen.logprob if chosen else None).model_dump(),
                top_logprobs=[self._chat_logprob(t, lp.logprob) for t, lp in self._top(candidates)],
            ))
        return content

    def _chat_logprob(self, token_id: int, logprob: float | None) -> ChatLogProb:
        text = self.label(token_id)
        raw = self._token_bytes(token_id) if self._token_bytes is not None else text.encode("utf-8")
        return ChatLogProb(token=text, logprob=finite(logprob), bytes=list(raw))

    def prompt_logprobs(self, logprobs: TokenLogprobs | None, num_top: int) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob, rank,
        decoded_token}} of the prompt's own token (the entry's first) and the `num_top` most likely."""
        if logprobs is None:
            return None
        return [None if entry is None else {
            str(t): PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=self.label(t))
            for i, (t, lp) in enumerate(entry.items()) if i == 0 or lp.rank is None or lp.rank <= num_top}
            for entry in logprobs]
