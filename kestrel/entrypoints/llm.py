"""LLM: the offline API. `LLM(model=DIR).generate(prompts, SamplingParams(...))`; `LLM()` runs kestrel-tiny."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from kestrel.engine.stats_logger import StatsLogger
from kestrel.entrypoints.beam_search import BeamSearch, BeamSearchOutput, advance_round, check_beam_width, next_round
from kestrel.entrypoints.chat import apply_chat_template
from kestrel.entrypoints.engine_factory import build_engine, engine_config
from kestrel.outputs import RequestOutput
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import BeamSearchParams, SamplingParams
from kestrel.tiny import default_model_path

PromptType = str | dict[str, Any]


def tokenize_prompt(tokenizer: Any, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text, {"prompt": text} or {"prompt_token_ids": [...]}."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
            raise InvalidRequestError("prompt_token_ids", "prompt_token_ids must be a list of integers")
        return prompt.get("prompt"), list(token_ids)
    if isinstance(prompt, dict) and "prompt" in prompt:
        return tokenize_prompt(tokenizer, prompt["prompt"])
    raise InvalidRequestError("prompt", f"a prompt must be a string or a dict with 'prompt' or "
                              f"'prompt_token_ids', got {type(prompt).__name__}")


class LLM:
    """An in-process engine. Keyword arguments are the engine arguments of `EngineConfig.from_kwargs`."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is None:
            model = str(default_model_path())
        engine_args.setdefault("disable_log_stats", True)  # as vLLM's LLM: the progress bar reports instead
        self.config = engine_config(str(model), **engine_args)
        built = build_engine(self.config)
        self.tokenizer, self.runner, self.engine = built.tokenizer, built.runner, built.core
        self._counter = itertools.count()
        self._stats_logger = None if self.config.disable_log_stats else StatsLogger()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json settings (temperature, top_p, top_k, min_p,
        repetition_penalty), as `generate` and `chat` use when given none."""
        return SamplingParams(**self.engine.generation_defaults.sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `use_tqdm`: a progress bar, or a
        tqdm-like class to build it with. `priority`: one value per prompt, lower first (needs
        scheduling_policy='priority')."""
        if lora_request is not None:
            raise InvalidRequestError("lora_request", "LoRA adapters are not supported; merge the adapter into "
                                      "the model's weights and load that checkpoint")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (list(sampling_params) if isinstance(sampling_params, Sequence)
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts; give one or "
                             "one per prompt")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidRequestError("priority", f"got {len(priorities)} priorities for {len(prompts)} prompts; "
                                      "give one per prompt")
        # generate() returns finished outputs only, so the engine need not build one every step.
        final = {id(p): p.replace(output_kind="final_only") for p in params_list}
        params_list = [final[id(p)] for p in params_list]
        ids = []
        try:
            for prompt, params, rank in zip(prompts, params_list, priorities):
                text, token_ids = self._tokenize(prompt)
                request_id = str(next(self._counter))
                self.engine.add_request(request_id, token_ids, params, prompt=text, priority=rank)
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the `beam_width` best sequences (prompt tokens included in `tokens`),
        ranked by length-penalized cumulative logprob. `concurrency_limit`: prompts searched at once."""
        if lora_request is not None:
            raise InvalidRequestError("lora_request", "LoRA adapters are not supported")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(
                concurrency_limit, int) or concurrency_limit < 1):
            raise InvalidRequestError("concurrency_limit", f"concurrency_limit must be an integer >= 1 or None, got "
                                      f"{concurrency_limit!r}")
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        check_beam_width(params, self.config.model.max_logprobs)
        searches = [BeamSearch(self._tokenize(p)[1], params, self.engine.eos_token_ids, self.engine.max_model_len)
                    for p in prompts]
        step_params = params.step_params()
        group = concurrency_limit or len(searches) or 1
        bar = tqdm(total=len(searches), desc="Beam search", unit="prompt", disable=not use_tqdm)
        for start in range(0, len(searches), group):
            active = searches[start: start + group]
            while beams := next_round(active):
                outputs = self.generate([{"prompt_token_ids": beam.tokens} for _, beam in beams],
                                        step_params, use_tqdm=False)
                advance_round(beams, [out.outputs[0].logprobs[0] for out in outputs])
            bar.update(len(active))
        bar.close()
        return [search.finish(self.tokenizer) for search in searches]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": apply_chat_template(self.tokenizer, conv, add_generation_prompt=add_generation_prompt,
                                                     chat_template=chat_template, tools=tools)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(request_ids), desc="Processed prompts", unit="req",
                       disable=not use_tqdm or len(wanted) < 2)
        started = time.perf_counter()
        prompt_tokens = output_tokens = 0
        try:
            while len(finished) < len(wanted) and self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                if self._stats_logger is not None:
                    self._stats_logger.maybe_log(self.engine.scheduler)
                for output in outputs:
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        prompt_tokens += len(output.prompt_token_ids)
                        output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        elapsed = max(time.perf_counter() - started, 1e-9)
                        # As vLLM's bar shows it: the rates over the requests finished so far.
                        bar.set_postfix_str(f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, "
                                            f"output: {output_tokens / elapsed:.2f} toks/s", refresh=False)
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def stats(self):
        return self.engine.scheduler.stats

    def get_expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start, by mixture-of-experts layer index: `{layer: [count per
        expert]}`, one count per (token, expert) assignment of every token the model computed (prompt tokens
        found in the prefix cache are not computed; a preempted request's are computed again). Read from the
        device now, so exact after `generate` returns; needs `LLM(..., expert_load_metrics=True)`."""
        if not self.config.expert_load_metrics:
            raise RuntimeError("the expert load is counted only with LLM(..., expert_load_metrics=True)")
        return self.runner.expert_load()
