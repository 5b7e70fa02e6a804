"""LLM: the offline API. `LLM(model=DIR).generate(prompts, SamplingParams(...))`; `LLM()` runs kestrel-tiny. The
pooling API (`embed`, `classify`, `score`, `encode`) answers as the server's pooling endpoints do, through the same
`pooling_tasks` helpers."""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from tqdm.auto import tqdm

from kestrel.engine.stats_logger import StatsLogger
from kestrel.entrypoints.beam_search import BeamSearch, BeamSearchOutput, advance_round, check_beam_width, next_round
from kestrel.entrypoints.chat import check_final_message_continued, render_chat, special_token_texts
from kestrel.entrypoints.engine_factory import build_engine, engine_config
from kestrel.entrypoints.media import (
    MediaLimits,
    MediaProcessor,
    chat_images,
    images_of,
    multi_modal_data,
    text_only_refusal,
)
from kestrel.entrypoints.pooling_tasks import (
    checked_dimensions,
    classifier_params,
    cosine,
    embedding_params,
    is_classifier,
    label_probs,
    refuse_classifier,
    require_classifier,
    require_cross_encoder,
    score_pairs,
    sigmoid,
)
from kestrel.entrypoints.prompt_compression import PARAM as COMPRESSION_PARAM
from kestrel.entrypoints.prompt_compression import PromptCompressor, build_prompt_compressor
from kestrel.entrypoints.token_encoding import encode_pair
from kestrel.inputs import PROMPT_KEYS, PromptType, cache_salt
from kestrel.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kestrel.pooling_params import PoolingParams
from kestrel.request import InvalidRequestError, MediaItem, truncate_prompt, truncation_size
from kestrel.sampling_params import BeamSearchParams, SamplingParams
from kestrel.tiny import default_model_path

PoolingTask = Literal["embed", "classify"]
POOLING_TASKS: tuple[PoolingTask, ...] = ("embed", "classify")


def tokenize_prompt(tokenizer: Any, prompt: PromptType,
                    add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text, {"prompt": text} or {"prompt_token_ids": [...]} (either with
    "multi_modal_data", which `prompt_media` reads)."""
    if isinstance(prompt, dict) and (unknown := sorted(set(prompt) - set(PROMPT_KEYS), key=str)):
        raise InvalidRequestError(str(unknown[0]), f"a prompt dict takes the keys {list(PROMPT_KEYS)}; "
                                  f"{unknown[0]!r} is not supported")
    if isinstance(prompt, str):
        return prompt, (tokenizer.encode(prompt) if add_special_tokens
                        else tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return tokenize_prompt(tokenizer, prompt["prompt"], add_special_tokens)
    raise InvalidRequestError("prompt", f"a prompt must be a string or a dict with 'prompt' or "
                              f"'prompt_token_ids', got {type(prompt).__name__}")


def _token_ids(value: Any) -> list[int]:
    """A TokensPrompt's ids as a list of ints: any sequence of integers (a list, a tuple, numpy or torch integers)."""
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        raise InvalidRequestError("prompt_token_ids", f"prompt_token_ids must be a sequence of integers, got "
                                  f"{type(value).__name__}")
    try:
        return [operator.index(t) for t in value]
    except TypeError:
        raise InvalidRequestError("prompt_token_ids", "prompt_token_ids must be a sequence of integers, got "
                                  + ", ".join(sorted({type(t).__name__ for t in value}))) from None


def prompt_media(media: MediaProcessor | None, prompt: PromptType,
                 token_ids: list[int]) -> tuple[list[int], tuple[MediaItem, ...]]:
    """A prompt's `multi_modal_data` (vLLM's {"image": PIL image or list}) through the model's processor `media`:
    its placeholders expanded and its media items; a prompt without one as it is."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if data is None:
        return token_ids, ()
    images = images_of(data, "multi_modal_data")
    if media is None:
        raise text_only_refusal("multi_modal_data")
    return media.expand(token_ids, images, "multi_modal_data")


def cut_to_params(text: str | None, token_ids: list[int], media: tuple[MediaItem, ...], params: SamplingParams,
                  max_model_len: int) -> tuple[str | None, list[int], SamplingParams]:
    """The prompt cut as its SamplingParams' truncate_prompt_tokens asks (`request.truncate_prompt`), and the
    params the engine takes, with that field cleared."""
    if params.truncate_prompt_tokens is None:
        return text, token_ids, params
    text, token_ids = truncate_prompt(text, token_ids, params.truncate_prompt_tokens, max_model_len, bool(media))
    return text, token_ids, params.replace(truncate_prompt_tokens=None)


class LLM:
    """An in-process engine. Keyword arguments are the engine arguments of `EngineConfig.from_kwargs`."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is None:
            model = str(default_model_path())
        engine_args.setdefault("disable_log_stats", True)  # as vLLM's LLM: the progress bar reports instead
        self.config = engine_config(str(model), **engine_args)
        # Before the served model, so that its memory plan sees the compressor's memory as taken.
        self.prompt_compressor: PromptCompressor | None = build_prompt_compressor(self.config)
        built = build_engine(self.config)
        self.tokenizer, self.runner, self.engine = built.tokenizer, built.runner, built.core
        self.media = built.media  # a multimodal model's processor; None: text only
        model = self.config.model
        self.media_limits = MediaLimits(model.allowed_local_media_path, model.allowed_media_domains)
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
        if not isinstance(prompts, Iterable):
            raise InvalidRequestError("prompts", f"prompts must be a prompt (text, or a dict with 'prompt' or "
                                      f"'prompt_token_ids') or a list of them, got {type(prompts).__name__}")
        prompts = list(prompts)
        params_list = self._sampling_params_list(sampling_params, len(prompts), "prompt")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidRequestError("priority", f"got {len(priorities)} priorities for {len(prompts)} prompts; "
                                      "give one per prompt")
        return self._generate(prompts, params_list, priorities, use_tqdm)

    def _generate(self, prompts: list[PromptType], params_list: list[SamplingParams], priorities: list[int],
                  use_tqdm: bool | Callable[..., Any], original_counts: Sequence[int | None] | None = None,
                  ) -> list[RequestOutput]:
        """`original_counts`: per prompt, its token count before a compression already done (LLM.chat)."""
        # generate() returns finished outputs only, so the engine need not build one every step.
        final = {id(p): p.replace(output_kind="final_only") for p in params_list}
        params_list = [final[id(p)] for p in params_list]
        ids = []
        originals: dict[str, int | None] = {}
        try:
            for k, (prompt, params, rank) in enumerate(zip(prompts, params_list, priorities)):
                original = original_counts[k] if original_counts is not None else None
                if params.prompt_compression is not None:
                    prompt, original = self._compressed_prompt(prompt, params)
                    params = params.replace(prompt_compression=None)
                text, token_ids = self._tokenize(prompt)
                token_ids, media = self._with_media(prompt, token_ids)
                text, token_ids, params = cut_to_params(text, token_ids, media, params, self.engine.max_model_len)
                request_id = str(next(self._counter))
                self.engine.add_request(request_id, token_ids, params, prompt=text, priority=rank, media=media,
                                        cache_salt=cache_salt(prompt))
                ids.append(request_id)
                originals[request_id] = original
        except Exception:
            self.engine.abort_request(ids)
            raise
        outputs = self._run(ids, use_tqdm)
        for output in outputs:
            output.original_num_prompt_tokens = originals.get(output.request_id)
        return outputs

    def _sampling_params_list(self, sampling_params: SamplingParams | Iterable[SamplingParams] | None, count: int,
                              what: str) -> list[SamplingParams]:
        """One SamplingParams per prompt (`what`: "prompt" or "conversation"): one for all, one each, or None for
        the model's defaults."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = ([sampling_params] * count if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params) if isinstance(sampling_params, Iterable)
                       and not isinstance(sampling_params, Mapping | str) else [sampling_params])
        if not all(isinstance(p, SamplingParams) for p in params_list):
            wrong = next(p for p in params_list if not isinstance(p, SamplingParams))
            raise InvalidRequestError("sampling_params", f"sampling_params must be a SamplingParams or a list of "
                                      f"them (one per {what}), got {type(wrong).__name__}: build "
                                      "SamplingParams(...) from its fields")
        if len(params_list) != count:
            raise ValueError(f"got {len(params_list)} sampling params for {count} {what}s; give one or one per "
                             f"{what}")
        return params_list

    def _with_media(self, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], tuple[MediaItem, ...]]:
        return prompt_media(self.media, prompt, token_ids)

    def _require_compressor(self) -> PromptCompressor:
        if self.prompt_compressor is None:
            raise InvalidRequestError(COMPRESSION_PARAM, "prompt_compression needs a compressor model: build the "
                                      "LLM with prompt_compressor='kestrel-tiny' (the bundled model) or a model "
                                      "directory (the --prompt-compressor flag of kestrel serve)")
        return self.prompt_compressor

    def _compressed_prompt(self, prompt: PromptType, params: SamplingParams) -> tuple[str, int]:
        """The prompt's compressed text and the original's token count."""
        compressor = self._require_compressor()
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
        if not isinstance(text, str):
            raise InvalidRequestError(COMPRESSION_PARAM, "prompt_compression compresses text: give the prompt as "
                                      "text, not prompt_token_ids")
        compressed = compressor.compress_text(text, params.prompt_compression, special_token_texts(self.tokenizer))
        return compressed.text or "", len(self.tokenizer.encode(text))

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
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError("params", f"LLM.beam_search takes a BeamSearchParams (beam_width, max_tokens, "
                                      f"ignore_eos, temperature, length_penalty), got {type(params).__name__}")
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        check_beam_width(params, self.config.model.max_logprobs)
        searches = [BeamSearch(self._tokenize(p, "LLM.beam_search", salted=False)[1], params,
                               self.engine.eos_token_ids, self.engine.max_model_len) for p in prompts]
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
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: Literal["auto", "string", "openai"] = "auto",
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate (vLLM's arguments):
        `continue_final_message` goes on with the assistant's last message (with add_generation_prompt=False);
        `chat_template_kwargs`: more template variables (e.g. enable_thinking); `chat_template_content_format`:
        each message's content handed to the template as one string ("string") or a list of parts ("openai");
        "auto": parts for a multimodal model or a template that loops over a message's content. Each output's
        `prompt` is its rendered conversation."""
        self._refuse_lora(lora_request)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params_list = self._sampling_params_list(sampling_params, len(conversations), "conversation")

        def template(conv: list[dict[str, Any]]) -> str:
            check_final_message_continued(continue_final_message, add_generation_prompt,
                                          conv[-1].get("role") if conv and isinstance(conv[-1], dict) else None)
            return render_chat(self.tokenizer, conv, tools=tools, tool_choice="auto" if tools else "none",
                               add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                               continue_final_message=continue_final_message, template_kwargs=chat_template_kwargs,
                               content_parts=self.media is not None,
                               content_format=chat_template_content_format).text

        def token_ids(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens

        prompts: list[PromptType] = []
        original_counts: list[int | None] = []
        for k, (conv, params) in enumerate(zip(conversations, params_list)):
            original = None
            if params.prompt_compression is not None:
                compressed = self._require_compressor().compress_messages(conv, params.prompt_compression)
                original = len(token_ids(template(conv)))
                conv = compressed.messages or conv
                params_list[k] = params.replace(prompt_compression=None)
            conv, images = chat_images(conv, self.media, self.media_limits)
            text = template(conv)
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids(text)}
            if images:
                prompt["multi_modal_data"] = multi_modal_data(images)
            prompts.append(prompt)
            original_counts.append(original)
        return self._generate(prompts, params_list, [0] * len(prompts), use_tqdm, original_counts)

    # ----- pooling: embed, classify, score, encode --------------------------------------------------

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, pooled as the model says (its pooler settings; a generation model: last
        token, normalized, as /v1/embeddings embeds with it). `pooling_params` (one, or one per prompt):
        `dimensions` (Matryoshka truncation, where config.json allows it), `normalize` and `pooling_type` (None:
        the model's). `truncate_prompt_tokens`: keep each prompt's last N tokens."""
        self._refuse_lora(lora_request)
        refuse_classifier(self.config.model, "LLM.embed", ("LLM.classify", "LLM.encode"), ("LLM.score",))
        prompts = self._prompt_list(prompts)
        params = self._pooling_params(pooling_params, len(prompts), "embed")
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(list(o.pooled or [])), o.prompt_token_ids,
                                       o.num_cached_tokens, o.finished)
                for o in self._pool(prompts, params, truncate_prompt_tokens, use_tqdm)]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities from a `*ForSequenceClassification` checkpoint (runner='pooling'):
        softmax over the labels, the sigmoid of a single label's logit, as /classify answers."""
        self._refuse_lora(lora_request)
        require_classifier(self.config.model, "LLM.classify")
        prompts = self._prompt_list(prompts)
        params = self._pooling_params(pooling_params, len(prompts), "classify")
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(label_probs(o.pooled or [])),
                                            o.prompt_token_ids, o.num_cached_tokens, o.finished)
                for o in self._pool(prompts, params, truncate_prompt_tokens, use_tqdm)]

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
    ) -> list[ScoringRequestOutput]:
        """A score per pair, paired as /score pairs `text_1` and `text_2`: one against one, one against many, or
        two lists of equal length by position. A cross-encoder (a classifier with one label) reads each pair as
        one sequence by the tokenizer's pair template and scores it by the sigmoid of its logit; an embedding
        (or generation) model embeds each side and scores by cosine similarity."""
        self._refuse_lora(lora_request)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise InvalidRequestError("pooling_params", f"pooling_params of LLM.score must be one PoolingParams "
                                      f"(every pair is pooled alike), got {type(pooling_params).__name__}")
        pairs = score_pairs(data_1, data_2, ("data_1", "data_2"))
        if is_classifier(self.config.model):
            require_cross_encoder(self.config.model, "LLM.classify")
            return self._cross_encoder_scores(pairs, pooling_params, truncate_prompt_tokens, use_tqdm)
        return self._bi_encoder_scores(pairs, pooling_params, truncate_prompt_tokens, use_tqdm)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        pooling_task: PoolingTask | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The pooled output as data. `pooling_task` None: what /pooling returns (an embedding, or a classifier's
        raw label logits); "embed" / "classify": what `embed` / `classify` return."""
        if pooling_task is not None and pooling_task not in POOLING_TASKS:
            raise InvalidRequestError("pooling_task", f"pooling_task={pooling_task!r} is not supported: kestrel "
                                      f"pools one vector per prompt, for {list(POOLING_TASKS)} or None (the "
                                      "model's own output); token-level pooling is not implemented")
        args = {"truncate_prompt_tokens": truncate_prompt_tokens, "use_tqdm": use_tqdm, "lora_request": lora_request}
        if pooling_task == "embed":
            return [PoolingRequestOutput(o.request_id, PoolingOutput(o.outputs.embedding), o.prompt_token_ids,
                                         o.num_cached_tokens, o.finished)
                    for o in self.embed(prompts, pooling_params, **args)]
        if pooling_task == "classify":
            return [PoolingRequestOutput(o.request_id, PoolingOutput(o.outputs.probs), o.prompt_token_ids,
                                         o.num_cached_tokens, o.finished)
                    for o in self.classify(prompts, pooling_params, **args)]
        self._refuse_lora(lora_request)
        prompts = self._prompt_list(prompts)
        task = "classify" if is_classifier(self.config.model) else "embed"
        params = self._pooling_params(pooling_params, len(prompts), task)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(list(o.pooled or [])), o.prompt_token_ids,
                                     o.num_cached_tokens, o.finished)
                for o in self._pool(prompts, params, truncate_prompt_tokens, use_tqdm)]

    def _cross_encoder_scores(self, pairs: list[tuple[PromptType, PromptType]], pooling_params: PoolingParams | None,
                              truncate: int | None, use_tqdm: bool | Callable[..., Any]) -> list[ScoringRequestOutput]:
        texts = [(self._pair_text(first, "data_1"), self._pair_text(second, "data_2")) for first, second in pairs]
        prompts: list[PromptType] = [{"prompt_token_ids": encode_pair(self.tokenizer, (), first, second, None)[1]}
                                     for first, second in texts]
        params = self._pooling_params(pooling_params, len(prompts), "classify")
        return [ScoringRequestOutput(o.request_id, ScoringOutput(sigmoid((o.pooled or [0.0])[0])),
                                     o.prompt_token_ids, o.num_cached_tokens, o.finished)
                for o in self._pool(prompts, params, truncate, use_tqdm)]

    def _bi_encoder_scores(self, pairs: list[tuple[PromptType, PromptType]], pooling_params: PoolingParams | None,
                           truncate: int | None, use_tqdm: bool | Callable[..., Any]) -> list[ScoringRequestOutput]:
        """Both sides embedded, each distinct prompt once, as /score does with an embedding model."""
        tokenized = [tuple(self._tokenize(side, "LLM.score", salted=False) for side in pair) for pair in pairs]
        distinct = list(dict.fromkeys(tuple(ids) for side in tokenized for _, ids in side))
        params = self._pooling_params(pooling_params, len(distinct), "embed")
        outputs = self._pool([{"prompt_token_ids": list(ids)} for ids in distinct], params, truncate, use_tqdm)
        by_ids = dict(zip(distinct, outputs))
        scores = []
        for (_, first), (_, second) in tokenized:
            a, b = by_ids[tuple(first)], by_ids[tuple(second)]
            scores.append(ScoringRequestOutput(
                f"{a.request_id}+{b.request_id}", ScoringOutput(cosine(a.pooled or [], b.pooled or [])),
                a.prompt_token_ids + b.prompt_token_ids, a.num_cached_tokens + b.num_cached_tokens,
                a.finished and b.finished))
        return scores

    def _pair_text(self, prompt: PromptType, param: str) -> str:
        """A cross-encoder's side of a pair: text, which the tokenizer's pair template joins."""
        if isinstance(prompt, dict) and set(prompt) == {"prompt"}:
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequestError(param, f"{param}: a cross-encoder scores text pairs (the tokenizer's pair "
                                      f"template joins them), so each item must be a string or {{'prompt': text}}, "
                                      f"got {type(prompt).__name__}"
                                      f"{' with prompt_token_ids' if isinstance(prompt, dict) else ''}")
        return prompt

    def _pooling_params(self, pooling_params: PoolingParams | Sequence[PoolingParams] | None, count: int,
                        task: PoolingTask) -> list[PoolingParams]:
        """One checked PoolingParams per prompt; None: the model's settings for `task`."""
        model = self.config.model
        if pooling_params is None:
            default = embedding_params(model) if task == "embed" else classifier_params(model)
            return [default] * count
        if isinstance(pooling_params, PoolingParams):
            items = [pooling_params] * count
        else:
            items = list(pooling_params) if isinstance(pooling_params, Sequence) else [pooling_params]
        if not all(isinstance(p, PoolingParams) for p in items):
            raise InvalidRequestError("pooling_params", "pooling_params must be a PoolingParams or a sequence of "
                                      f"them, one per prompt, got {type(pooling_params).__name__}")
        if len(items) != count:
            raise InvalidRequestError("pooling_params", f"got {len(items)} pooling_params for {count} prompts; "
                                      "give one or one per prompt")
        checked = {}
        for params in items:
            if id(params) not in checked:
                checked[id(params)] = self._checked_params(params, task)
        return [checked[id(p)] for p in items]

    def _checked_params(self, params: PoolingParams, task: PoolingTask) -> PoolingParams:
        model = self.config.model
        if task == "embed":
            dimensions = checked_dimensions(model.hf_config, params.dimensions, "pooling_params.dimensions")
            return dataclasses.replace(params, dimensions=dimensions)
        labels = model.pooler.num_labels if model.pooler is not None else 0
        if params.dimensions is not None:
            raise InvalidRequestError("pooling_params.dimensions", f"pooling_params.dimensions={params.dimensions}: "
                                      f"a classifier's output is its {labels} label logits, which cannot be "
                                      "truncated; leave dimensions out")
        if params.normalize:
            raise InvalidRequestError("pooling_params.normalize", "pooling_params.normalize=True: a classifier's "
                                      "label logits are turned into probabilities (softmax, or the sigmoid of one "
                                      "label), not L2-normalized; leave normalize out")
        return dataclasses.replace(params, normalize=False)

    def _pool(self, prompts: Sequence[PromptType], params: list[PoolingParams], truncate: int | None,
              use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        """Every prompt as a pooling request (all or none queued), run to its pooled output, in input order."""
        truncation_size(truncate, self.engine.max_model_len)  # checked before any prompt is queued
        ids: list[str] = []
        try:
            for prompt, pooling in zip(prompts, params):
                text, token_ids = self._tokenize(prompt, "pooling (embed, classify, score, encode)")
                text, token_ids = truncate_prompt(text, token_ids, truncate, self.engine.max_model_len)
                request_id = str(next(self._counter))
                self.engine.add_request(request_id, token_ids, pooling, prompt=text, cache_salt=cache_salt(prompt))
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)
            raise
        outputs = self._run(ids, use_tqdm)
        if any(output.pooled is None for output in outputs):
            raise RuntimeError("a pooling request ended without its pooled output")
        return outputs

    @staticmethod
    def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        return [prompts] if isinstance(prompts, str | dict) else list(prompts)

    @staticmethod
    def _refuse_lora(lora_request: Any) -> None:
        if lora_request is not None:
            raise InvalidRequestError("lora_request", "lora_request: LoRA adapters are not supported; merge the "
                                      "adapter into the model's weights and load that checkpoint")

    def _tokenize(self, prompt: PromptType, text_only: str | None = None,
                  salted: bool = True) -> tuple[str | None, list[int]]:
        """`text_only`: the method, which takes no multi_modal_data (refused, naming it); `salted=False`: nor a
        cache_salt (its prompts are not requests of their own)."""
        if text_only is not None and isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            raise InvalidRequestError("multi_modal_data", f"{text_only} takes text prompts only; send the prompt "
                                      "without multi_modal_data (LLM.generate takes images)")
        if not salted and cache_salt(prompt) is not None:
            raise InvalidRequestError("cache_salt", f"{text_only} takes no cache_salt; LLM.generate and the pooling "
                                      "methods do")
        # An encoder-decoder model's text prompt is its decoder prompt with the special tokens written out
        # ("<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"): the tokenizer adds none of its own.
        decoder_prompt = self.media is not None and getattr(self.media, "encoder_decoder", False)
        return tokenize_prompt(self.tokenizer, prompt, add_special_tokens=not decoder_prompt)

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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's method, for benchmarks that must not reuse one); only
        possible between generate calls, while no request holds a block: False otherwise."""
        return self.engine.reset_prefix_cache()

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
