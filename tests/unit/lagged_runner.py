"""LaggedRunner: a pure-Python worker with the ModelRunner's two verbs (`sample_tokens(non_block=True)` hands back a
step collected later), for async scheduling tests (and WordTokenizer, a one-word-per-id tokenizer for engines built
around it).

It holds exactly `max_rows` rows (as the runner's block table holds `max_num_seqs`) and fails loudly when a
step would need more, reads a token still in flight as the device would (at most one per request), and
"samples" the token at each position as a fixed function of the prompt and the position, so the tokens
every finished request must carry are known without running the engine (`expected_tokens`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kestrel.engine.contracts import GrammarBitmask, ModelRunnerOutput, Ready, SchedulerOutput


def token_at(prompt: tuple[int, ...], position: int, vocab_size: int, eos_token_id: int, eos_rate: float) -> int:
    rng = random.Random(hash((prompt, position)))
    if rng.random() < eos_rate:
        return eos_token_id
    token = rng.randrange(vocab_size)
    return token if token != eos_token_id else (token + 1) % vocab_size


@dataclass
class _State:
    prompt: tuple[int, ...]
    tokens: list[int]
    blocks: list[int]
    computed: int
    row: int
    pending: int = 0


@dataclass
class _Launched:
    req_ids: list[str]
    sampled: list[tuple[_State, int] | None]


@dataclass
class _Handle:
    runner: LaggedRunner
    launched: _Launched

    def result(self) -> ModelRunnerOutput:
        return self.runner.collect(self.launched)


@dataclass
class LaggedRunner:
    max_rows: int
    vocab_size: int
    eos_token_id: int
    block_size: int = 16
    eos_rate: float = 0.0
    state: dict[str, _State] = field(default_factory=dict)
    free_rows: list[int] = field(default_factory=list)
    in_flight: int = 0
    peak_rows: int = 0
    steps: int = 0
    executed: _Launched | None = None

    def __post_init__(self) -> None:
        self.free_rows = list(range(self.max_rows))

    @property
    def rows_in_use(self) -> int:
        return self.max_rows - len(self.free_rows)

    def execute_model(self, out: SchedulerOutput, non_block: bool = False):
        assert self.executed is None, "execute_model twice without sample_tokens"
        launched = self.launch(out)
        if launched.req_ids:
            self.executed = launched
            return Ready() if non_block else None
        output = self.collect(launched)
        return Ready(output) if non_block else output

    def sample_tokens(self, grammar: GrammarBitmask | None, non_block: bool = False):
        assert self.executed is not None, "sample_tokens without a step executed"
        handle = _Handle(self, self.executed)
        self.executed = None
        return handle if non_block else handle.result()

    def launch(self, out: SchedulerOutput) -> _Launched:
        assert self.in_flight <= 1, "a step was launched with two others still in flight"
        for rid in out.finished_req_ids | out.preempted_req_ids:
            state = self.state.pop(rid, None)
            if state is not None:
                self.free_rows.append(state.row)
        for new in out.new_requests:
            assert new.req_id not in self.state, f"{new.req_id} sent as new while the runner holds it"
            if not self.free_rows:
                raise RuntimeError(f"rows overrun: {self.max_rows} rows in use")
            prompt = tuple(new.token_ids[: new.num_prompt_tokens])
            self.state[new.req_id] = _State(prompt, list(new.token_ids), list(new.block_ids[0]),
                                            new.num_computed_tokens, self.free_rows.pop())
        self.peak_rows = max(self.peak_rows, self.rows_in_use)
        for cached in out.cached_requests:
            state = self.state[cached.req_id]
            assert state.computed == cached.num_computed_tokens, f"{cached.req_id}: the runner's count disagrees"
            if cached.new_block_ids:
                state.blocks.extend(cached.new_block_ids[0])
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[tuple[_State, int] | None] = []
        for rid in req_ids:
            state = self.state[rid]
            count = out.num_scheduled_tokens[rid]
            end = state.computed + count
            known = len(state.tokens)
            if end > known:  # the last input token is still in flight: read on the device
                assert end - known == 1 and state.pending == 1, f"{rid}: positions {known}..{end} unknown"
            assert len(state.blocks) * self.block_size >= end, f"{rid}: tokens scheduled without blocks"
            state.computed = end
            if end >= known + state.pending:
                position = end
                state.pending += 1
                sampled.append((state, token_at(state.prompt, position, self.vocab_size, self.eos_token_id,
                                                self.eos_rate)))
            else:
                sampled.append(None)
        if req_ids:
            self.in_flight += 1
            self.steps += 1
        return _Launched(req_ids, sampled)

    def collect(self, launched: _Launched) -> ModelRunnerOutput:
        if launched.req_ids:
            self.in_flight -= 1
        tokens: list[list[int]] = []
        for item in launched.sampled:
            if item is None:
                tokens.append([])
                continue
            state, token = item
            state.pending -= 1
            state.tokens.append(token)
            tokens.append([token])
        return ModelRunnerOutput(launched.req_ids, tokens, [None] * len(tokens))

    def expected_tokens(self, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
        """The output a request must get: tokens at positions len(prompt).. until EOS or max_tokens."""
        out: list[int] = []
        while len(out) < max_tokens:
            token = token_at(tuple(prompt), len(prompt) + len(out), self.vocab_size, self.eos_token_id,
                             self.eos_rate)
            out.append(token)
            if token == self.eos_token_id and not ignore_eos:
                break
        return out


class WordTokenizer:
    """Enough of a tokenizer for the detokenizer: one word per id; `eos_token_id` is the only special id."""

    def __init__(self, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.all_special_ids = [eos_token_id]

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        return [f"w{i}" for i in ids if not (skip_special_tokens and i == self.eos_token_id)]

    def convert_tokens_to_string(self, tokens):
        return " ".join(tokens)

    def decode(self, ids, skip_special_tokens=False):
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids, skip_special_tokens))
