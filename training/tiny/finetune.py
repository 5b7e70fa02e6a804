"""Chat fine-tune of kestrel-tiny: stdlib questions and answers (`training.tiny.qa`) mixed with stdlib source.

`scripts/finetune_tiny.py` is the command line; tests call `finetune()` with a small `FinetuneOptions`.

Each step trains on two batches: `batch_size` conversations (the tokenizer's chat template: user question,
assistant answer ending with the eos the template writes), whose loss counts only the answer tokens and that
eos; and `code_batch_size` windows of the packed train-split source (as in pre-training), so the model keeps
its code perplexity. The objective is `(1 - code_weight) * answer loss + code_weight * source loss`.

Everything trained on comes from the train split of `kestrel.tiny.corpus` minus the validation slice of
`training.tiny.train` (files with crc32 % 100 == 1). Each validation measures the answer loss on that slice's
pairs (functions never trained on), on a fixed sample of the training pairs ("recall": what the model has
learnt of the docs) and the source loss on that slice's files; by default the weights kept are those with the
best recall among the validations whose source loss is at most `max_source_drift` above the base's. The
held-out (eval-split) files are never used to choose anything: they are only scored, before and after, with
`kestrel bench ppl`'s code through kestrel's engine.

Output: the six files of the bundled model (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, special_tokens_map.json; the tokenizer files copied unchanged from the
base) plus finetune_log.json.
"""

from __future__ import annotations

import gc
import json
import platform
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

import kestrel.bench.ppl as ppl
from kestrel.entrypoints.chat import apply_chat_template
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.tiny import BUNDLED_MODEL_DIR, corpus
from training.tiny import qa
from training.tiny.model import TinyConfig, TinyLlama, num_parameters, rope_tables, save_hf_model
from training.tiny.tokenizer import encode_documents
from training.tiny.train import (
    MAX_SAFETENSORS_BYTES,
    SAVE_RESERVE_S,
    _environment,
    _write_json,
    autocast,
    evaluate,
    lr_at,
    make_optimizer,
    pack,
    resolve_device,
    run_progress,
    sample_batch,
    split_files,
    val_windows,
)

IGNORE = -100
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES)
LOG_FILE = "finetune_log.json"
SELECT_CHOICES = ("recall", "val", "last")
# Asked (greedy) before and after; the last one is about an eval-split module (shutil.py), never trained on.
DEFAULT_QUESTIONS = (
    "What does `os.path.join` do?",
    "What does `json.dumps` do?",
    "How do I use `textwrap.dedent`?",
    "What does `shutil.copyfile` do?",
)
# KV cache for the scoring and sampling engines: enough for 64 windows of 512 tokens in fp32, and small next
# to training on a GPU (the engine would otherwise take a fraction of the whole device).
ENGINE_KV_BYTES = 512 << 20


@dataclass
class FinetuneOptions:
    out: Path
    base: Path = BUNDLED_MODEL_DIR
    minutes: float = 8.0
    steps: int | None = None
    max_total_minutes: float | None = None
    device: str = "auto"
    seed: int = 0
    batch_size: int = 32  # conversations per step
    code_batch_size: int = 16  # source windows per step
    code_context: int | None = None  # tokens per source window (default: the model's context)
    code_weight: float = 0.7  # share of the objective on source windows
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    dropout: float = 0.1  # as in pre-training; without it the source loss drifts up (docs/kestrel-tiny.md)
    grad_clip: float = 1.0
    eval_every: int = 100
    log_every: int = 10
    val_tokens: int = 65_536  # source tokens per validation (at most)
    max_val_pairs: int = 512
    recall_pairs: int = 256  # training pairs whose answer loss is tracked (evenly spread)
    # Which validated weights are written: "recall" (the lowest answer loss on the tracked training pairs among
    # those whose validation source loss is at most max_source_drift nats above the base's), "val" (the lowest
    # mix of validation answer and source loss, weighted as the objective) or "last".
    select: str = "recall"
    max_source_drift: float = 0.02
    max_train_files: int | None = None  # use this many train files (evenly spread) for pairs and source
    max_pairs: int | None = None  # train on this many pairs (evenly spread)
    heldout_files: int | None = None  # held-out files scored before and after (None: all; 0: skip)
    questions: tuple[str, ...] = DEFAULT_QUESTIONS
    sample_tokens: int = 48
    save_dtype: str = "bfloat16"
    quiet: bool = False


@dataclass
class Example:
    """One tokenized conversation: `ids` = prompt + answer + eos; the first `prompt_len` ids are not learned."""
    ids: list[int]
    prompt_len: int

    def tensors(self) -> tuple[list[int], list[int]]:
        """(inputs, targets): next-token targets, IGNORE where the target is still part of the prompt."""
        inputs = self.ids[:-1]
        targets = [t if i + 1 >= self.prompt_len else IGNORE for i, t in enumerate(self.ids[1:])]
        return inputs, targets


@dataclass
class FinetuneResult:
    out: Path
    safetensors_bytes: int
    log: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ model io


def config_from_hf(path: Path) -> TinyConfig:
    c = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return TinyConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                      intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
                      num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                      max_position=c["max_position_embeddings"], rope_theta=c["rope_theta"],
                      rms_norm_eps=c["rms_norm_eps"], tie_word_embeddings=c["tie_word_embeddings"],
                      init_std=c.get("initializer_range", 0.02))


def load_tiny(path: str | Path, dropout: float = 0.0) -> TinyLlama:
    """A kestrel-tiny directory (as `save_hf_model` writes it) back as a float32 TinyLlama on the CPU."""
    path = Path(path)
    model = TinyLlama(config_from_hf(path), dropout=dropout)
    state = load_file(str(path / "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model


# ------------------------------------------------------------------------------------------------ data


def encode_pair(tokenizer: Any, pair: qa.QAPair, eos_id: int, context: int) -> Example:
    """The conversation's ids as kestrel's chat prompt encodes the question (template, generation prompt),
    then the answer's ids and eos: what the model must generate after that prompt. Cut to context + 1."""
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": pair.question}], add_generation_prompt=True)
    answer = tokenizer.encode(pair.answer.strip(), add_special_tokens=False) + [eos_id]
    ids = (prompt + answer)[: context + 1]
    return Example(ids, min(len(prompt), len(ids) - 1))


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [batch, longest] inputs and targets (padding targets IGNORE; causal attention means the
    padding never changes the real positions)."""
    rows = [e.tensors() for e in examples]
    width = max(len(i) for i, _ in rows)
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (i, t) in enumerate(rows):
        inputs[r, : len(i)] = torch.tensor(i)
        targets[r, : len(t)] = torch.tensor(t)
    return inputs, targets


def final_hidden(model: TinyLlama, input_ids: torch.Tensor) -> torch.Tensor:
    """The normalized last hidden states [batch, time, hidden]: `TinyLlama.forward` without the output head."""
    cos, sin = rope_tables(model.cfg, input_ids.shape[1], input_ids.device)
    x = model.model.embed_tokens(input_ids)
    for layer in model.model.layers:
        x = layer(x, cos, sin, model.dropout)
    return model.model.norm(x)


def masked_loss(model: TinyLlama, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the positions whose target is not IGNORE (the answer tokens); the output
    head (a third of the model's work per token) runs only at those positions."""
    keep = targets != IGNORE
    hidden = final_hidden(model, inputs)[keep]
    logits = F.linear(hidden, model.head_weight())
    return F.cross_entropy(logits.float(), targets[keep])


@dataclass
class Data:
    train_examples: list[Example]
    val_examples: list[Example]
    recall_examples: list[Example]
    code_train: torch.Tensor
    code_val: torch.Tensor
    stats: dict[str, Any]


def prepare_data(opts: FinetuneOptions, hf_tokenizer: Any, context: int) -> Data:
    train_set, val_set = split_files(opts.max_train_files)
    train_pairs = qa.build_pairs(train_set)
    val_pairs = qa.build_pairs(val_set)
    if opts.max_pairs is not None:
        train_pairs = [train_pairs[i * len(train_pairs) // opts.max_pairs]
                       for i in range(min(opts.max_pairs, len(train_pairs)))]
    if len(val_pairs) > opts.max_val_pairs:
        val_pairs = [val_pairs[i * len(val_pairs) // opts.max_val_pairs] for i in range(opts.max_val_pairs)]
    if not train_pairs:
        raise ValueError("no question/answer pairs in the chosen train files")
    eos = hf_tokenizer.eos_token_id
    bos = hf_tokenizer.bos_token_id
    train_examples = [encode_pair(hf_tokenizer, p, eos, context) for p in train_pairs]
    val_examples = [encode_pair(hf_tokenizer, p, eos, context) for p in val_pairs]
    fast = Tokenizer.from_file(str(Path(opts.base) / "tokenizer.json"))
    code_train = pack(encode_documents(fast, corpus.texts(train_set)), bos, eos)
    code_val = pack(encode_documents(fast, corpus.texts(val_set)), bos, eos)
    code_context = opts.code_context or context
    if len(code_train) <= code_context + 1:
        raise ValueError(f"only {len(code_train)} source tokens; need more than the window {code_context}")
    sources = sorted({p.source for p in train_pairs} | {p.source for p in val_pairs})
    answer_tokens = [len(e.ids) - e.prompt_len for e in train_examples]
    stats = {
        "python": platform.python_version(),
        "stdlib": str(corpus.stdlib_root()),
        "train_files": len(train_set),
        "val_files": len(val_set),
        "qa_train_pairs": len(train_pairs),
        "qa_val_pairs": len(val_pairs),
        "qa_names": len({p.name for p in train_pairs}),
        "qa_kinds": {k: sum(p.kind == k for p in train_pairs) for k in ("function", "class", "method")},
        "qa_source_files": len(sources),
        "qa_eval_split_sources": sum(corpus.is_eval_path(s) for s in sources),
        "qa_train_tokens": sum(len(e.ids) for e in train_examples),
        "qa_answer_tokens": sum(answer_tokens),
        "qa_mean_answer_tokens": sum(answer_tokens) / len(answer_tokens),
        "code_train_tokens": len(code_train),
        "code_val_tokens": len(code_val),
    }
    count = max(1, min(opts.recall_pairs, len(train_examples)))
    recall = [train_examples[i * len(train_examples) // count] for i in range(count)]
    return Data(train_examples, val_examples, recall, code_train,
                val_windows(code_val, code_context, opts.val_tokens) if len(code_val) > code_context + 1 else
                code_val[: 0].view(0, code_context + 1), stats)


class ExampleSampler:
    """Batches of example indices: each epoch is a seeded shuffle, cut into pools of `pool` batches; a pool is
    sorted by length, cut into batches and those are shuffled, so a batch holds examples of similar length
    (little padding) while every example is still seen once per epoch."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, pool: int = 16) -> None:
        self.lengths, self.batch_size, self.pool = lengths, batch_size, pool
        self.rng = random.Random(seed)
        self.batches: list[list[int]] = []
        self.epochs = 0

    def _refill(self) -> None:
        order = list(range(len(self.lengths)))
        self.rng.shuffle(order)
        size = self.batch_size * self.pool
        for start in range(0, len(order), size):
            chunk = sorted(order[start: start + size], key=lambda i: self.lengths[i])
            batches = [chunk[i: i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
            self.rng.shuffle(batches)
            self.batches.extend(batches)
        self.batches.reverse()  # popped from the end
        self.epochs += 1

    def take(self) -> list[int]:
        if not self.batches:
            self._refill()
        return self.batches.pop()


# ------------------------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def qa_loss(model: TinyLlama, examples: list[Example], device: torch.device, batch_size: int, pad_id: int) -> float:
    """Mean answer-token loss (nats) over the examples."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        inputs, targets = collate(examples[start: start + batch_size], pad_id)
        inputs, targets = inputs.to(device), targets.to(device)
        n = int((targets != IGNORE).sum())
        with autocast(device):
            loss = masked_loss(model, inputs, targets)
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / max(1, count)


def heldout_perplexity(model_dir: Path, device: torch.device, max_files: int | None) -> dict[str, Any]:
    """Perplexity of the model directory on the held-out (eval-split) files, as `kestrel bench ppl` measures it
    (float32, windows of max_model_len - 1 tokens, stride half a window); no unigram baseline."""
    started = time.perf_counter()
    scorer = ppl.KestrelScorer(str(model_dir), dtype="float32", device=device.type,
                               kv_cache_memory_bytes=ENGINE_KV_BYTES, max_num_seqs=64, max_num_batched_tokens=4096)
    try:
        files = corpus.select_evenly([f for f in corpus.eval_files() if f.path.stat().st_size > 0], max_files)
        documents = ppl.load_documents(scorer.tokenizer, files)
        window = scorer.max_model_len - 1
        windows = ppl.make_windows(documents, window, window // 2)
        nll = sum(scorer.window_nll(documents, windows, use_tqdm=False))
        tokens = sum(d.num_scored for d in documents)
        result = {"files": len(documents), "tokens": tokens, "bytes": sum(d.num_bytes for d in documents),
                  **ppl.summarize(nll, tokens, sum(d.num_bytes for d in documents))}
    finally:
        del scorer
        _release(device)
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def answers(model_dir: Path, device: torch.device, questions: tuple[str, ...], max_tokens: int) -> list[dict]:
    """Greedy chat replies of the model directory through kestrel's LLM."""
    if not questions:
        return []
    from kestrel import LLM, SamplingParams

    llm = LLM(str(model_dir), device=device.type, kv_cache_memory_bytes=ENGINE_KV_BYTES)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
        return [{"question": q, "answer": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason}
                for q, o in zip(questions, outs)]
    finally:
        del llm
        _release(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ the run


def finetune(opts: FinetuneOptions) -> FinetuneResult:
    """Score the base, fine-tune until the step count or wall-clock budget is used, write and score the result."""
    script_start = time.perf_counter()
    if opts.select not in SELECT_CHOICES:
        raise ValueError(f"select={opts.select!r}: expected one of {SELECT_CHOICES}")
    device = resolve_device(opts.device)
    torch.manual_seed(opts.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    base, out = Path(opts.base), Path(opts.out)
    if out.resolve() == base.resolve():
        raise ValueError(f"--out {out} is the base model's directory; write the fine-tune somewhere else")
    missing = [n for n in MODEL_FILES if not (base / n).is_file()]
    if missing:
        raise ValueError(f"the base directory {base} lacks {', '.join(missing)}")
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda _msg: None) if opts.quiet else (lambda msg: print(msg, flush=True))
    log: dict[str, Any] = {"options": _options_json(opts), "environment": _environment(device), "timing": {},
                           "train": [], "val": []}

    run = _Run(opts, device, base, out, log, say, script_start)
    run.prepare()
    if opts.heldout_files != 0:
        log["heldout_before"] = heldout_perplexity(base, device, opts.heldout_files)
        say(f"held-out perplexity of the base: {log['heldout_before']['perplexity']:.3f} "
            f"({log['heldout_before']['files']} files, {log['heldout_before']['seconds']:.0f} s)")
    log["samples_before"] = answers(base, device, opts.questions, opts.sample_tokens)
    # Time kept back for the end: the last validation, the writes, and scoring again what was scored before.
    log["timing"]["reserve_s"] = SAVE_RESERVE_S + 1.5 * (time.perf_counter() - run.prepared_at)
    run.loop()
    size = run.finish()
    if opts.heldout_files != 0:
        log["heldout_after"] = heldout_perplexity(out, device, opts.heldout_files)
        say(f"held-out perplexity after: {log['heldout_after']['perplexity']:.3f} "
            f"(before {log['heldout_before']['perplexity']:.3f})")
    log["samples_after"] = answers(out, device, opts.questions, opts.sample_tokens)
    for s in log["samples_after"]:
        say(f"Q: {s['question']}\nA: {s['answer']!r}")
    log["timing"]["total_s"] = time.perf_counter() - script_start
    _write_json(out / LOG_FILE, log)
    if size > MAX_SAFETENSORS_BYTES:
        say(f"warning: model.safetensors is {size:,} bytes, over the {MAX_SAFETENSORS_BYTES:,} limit")
    return FinetuneResult(out, size, log)


class _Run:
    def __init__(self, opts: FinetuneOptions, device: torch.device, base: Path, out: Path, log: dict[str, Any],
                 say, script_start: float) -> None:
        self.opts, self.device, self.base, self.out, self.log, self.say = opts, device, base, out, log, say
        self.script_start = script_start
        self.step = self.qa_examples = self.qa_tokens = self.code_tokens = 0
        self.best: dict[str, Any] = {"step": -1}
        self.base_val: dict[str, Any] = {}
        self.best_state: dict[str, torch.Tensor] = {}
        self.loop_s = 0.0

    def prepare(self) -> None:
        opts = self.opts
        started = time.perf_counter()
        self.tokenizer = load_tokenizer(str(self.base))
        self.eos, self.bos = self.tokenizer.eos_token_id, self.tokenizer.bos_token_id
        self.model = load_tiny(self.base, dropout=opts.dropout).to(self.device)
        self.cfg = self.model.cfg
        self.code_context = opts.code_context or self.cfg.max_position
        if not 1 <= self.code_context <= self.cfg.max_position:
            raise ValueError(f"code_context={self.code_context}: expected 1..{self.cfg.max_position}")
        data = prepare_data(opts, self.tokenizer, self.cfg.max_position)
        self.data = data
        self.log["data"] = data.stats
        self.log["num_parameters"] = num_parameters(self.model)
        self.code_train = data.code_train.to(self.device)
        self.code_val = data.code_val.to(self.device)
        self.sampler = ExampleSampler([len(e.ids) for e in data.train_examples], opts.batch_size, opts.seed)
        self.generator = torch.Generator().manual_seed(opts.seed)
        self.optimizer = make_optimizer(self.model, opts, self.device)  # type: ignore[arg-type]
        self.log["timing"]["prepare_s"] = time.perf_counter() - started
        s = data.stats
        self.say(f"data: {s['qa_train_pairs']:,} QA pairs ({s['qa_names']:,} names, {s['qa_answer_tokens']:,} answer "
                 f"tokens) from {s['qa_source_files']} train-split files, {s['qa_val_pairs']} validation pairs; "
                 f"source {s['code_train_tokens']:,} tokens; model {self.log['num_parameters']:,} parameters on "
                 f"{self.device}; prep {self.log['timing']['prepare_s']:.1f} s")
        self.prepared_at = time.perf_counter()

    def loop(self) -> None:
        opts = self.opts
        self._validate(0.0)
        loop_start = time.perf_counter()
        budget_s = opts.minutes * 60.0
        deadline = None
        if opts.max_total_minutes is not None:
            deadline = self.script_start + opts.max_total_minutes * 60 - self.log["timing"]["reserve_s"]
            budget_s = max(1.0, min(budget_s, deadline - loop_start))
        self.log["timing"]["train_budget_s"] = budget_s
        sums: dict[str, torch.Tensor | float] = {"loss": 0.0, "qa": 0.0, "code": 0.0}
        count = 0
        self.model.train()
        while (progress := run_progress(self.step, opts.steps, loop_start, budget_s, deadline)) is not None:
            lr = lr_at(opts, self.step, progress)  # type: ignore[arg-type]
            for key, value in self._train_step(lr).items():
                sums[key] += value
            count += 1
            if self.step % opts.log_every == 0:
                elapsed = time.perf_counter() - loop_start
                row = {"step": self.step, "seconds": round(elapsed, 2), "lr": lr,
                       **{k: float(v) / count for k, v in sums.items()}}
                self.log["train"].append(row)
                self.say(f"step {self.step:6d}  loss {row['loss']:.4f}  answers {row['qa']:.4f}  "
                         f"source {row['code']:.4f}  lr {lr:.2e}  {elapsed:.0f} s")
                sums, count = dict.fromkeys(sums, 0.0), 0
            if self.step % opts.eval_every == 0:
                self._validate(time.perf_counter() - loop_start)
        self.loop_s = time.perf_counter() - loop_start

    def _train_step(self, lr: float) -> dict[str, torch.Tensor]:
        opts = self.opts
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        examples = [self.data.train_examples[i] for i in self.sampler.take()]
        self.qa_examples += len(examples)
        qa_in, qa_tg = collate(examples, self.eos)
        self.qa_tokens += int((qa_tg != IGNORE).sum())
        qa_in, qa_tg = qa_in.to(self.device, non_blocking=True), qa_tg.to(self.device, non_blocking=True)
        with autocast(self.device):
            answer_loss = masked_loss(self.model, qa_in, qa_tg)
            loss = (1.0 - opts.code_weight) * answer_loss
            code_loss = torch.zeros((), device=self.device)
            if opts.code_batch_size > 0 and opts.code_weight > 0:
                code_in, code_tg = sample_batch(self.code_train, opts.code_batch_size, self.code_context,
                                                self.generator, self.device)
                code_loss = self.model.loss(code_in, code_tg)
                loss = loss + opts.code_weight * code_loss
                self.code_tokens += code_in.numel()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), opts.grad_clip)
        self.optimizer.step()
        self.step += 1
        # Kept on the device (summed there); read back only when logged.
        return {"loss": loss.detach(), "qa": answer_loss.detach(), "code": code_loss.detach()}

    def _validate(self, elapsed: float) -> None:
        """Answer loss on the validation pairs (`qa`, questions about functions never trained on) and on a fixed
        sample of the training pairs (`recall`), source loss on the validation windows (`code`); the weights
        that `select` prefers so far are kept and written."""
        opts, data = self.opts, self.data
        row: dict[str, Any] = {"step": self.step, "seconds": round(elapsed, 2)}
        row["qa"] = qa_loss(self.model, data.val_examples, self.device, opts.batch_size, self.eos) \
            if data.val_examples else None
        row["recall"] = qa_loss(self.model, data.recall_examples, self.device, opts.batch_size, self.eos)
        row["code"] = evaluate(self.model, self.code_val, self.device, max(1, opts.code_batch_size)) \
            if len(self.code_val) else None
        parts = [(w, v) for w, v in ((1.0 - opts.code_weight, row["qa"]), (opts.code_weight, row["code"]))
                 if v is not None]
        row["loss"] = sum(w * v for w, v in parts) / max(1e-12, sum(w for w, _ in parts))
        if self.step == 0:
            self.base_val = dict(row)
        self.log["val"].append(row)
        shown = "  ".join(f"{k} {'-' if row[k] is None else format(row[k], '.4f')}"
                          for k in ("loss", "qa", "recall", "code"))
        self.say(f"step {self.step:6d}  val: {shown}")
        if self._preferred(row):
            self.best = {k: row[k] for k in ("step", "loss", "qa", "recall", "code")}
            self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self._save()

    def _preferred(self, row: dict[str, Any]) -> bool:
        """Whether the weights of this validation replace the kept ones (see FinetuneOptions.select)."""
        if not self.best_state or self.opts.select == "last":
            return True
        if self.opts.select == "val":
            return row["loss"] < self.best["loss"]
        base_code = self.base_val["code"]
        within = row["code"] is None or base_code is None or row["code"] <= base_code + self.opts.max_source_drift
        return within and row["recall"] < self.best["recall"]

    def _save(self) -> int:
        size = save_hf_model(self.model, self.out, self.bos, self.eos, self.opts.save_dtype)
        (self.out / "model.safetensors").chmod(0o644)  # as the other files (the writer makes it private)
        for name in TOKENIZER_FILES:
            shutil.copyfile(self.base / name, self.out / name)
        _write_json(self.out / LOG_FILE, self.log)
        return size

    def finish(self) -> int:
        if not self.log["val"] or self.log["val"][-1]["step"] != self.step:
            self._validate(self.loop_s)
        if self.best["step"] != self.step:  # the last weights are not the best validated ones
            self.model.load_state_dict(self.best_state)
        size = self._save()
        self.log.update(steps=self.step, best=self.best, safetensors_bytes=size, qa_answer_tokens_seen=self.qa_tokens,
                        code_tokens_seen=self.code_tokens,
                        qa_epochs=self.qa_examples / max(1, len(self.data.train_examples)))
        self.log["timing"]["train_loop_s"] = self.loop_s
        _write_json(self.out / LOG_FILE, self.log)
        self.say(f"done: {self.step} steps in {self.loop_s:.0f} s ({self.log['qa_epochs']:.2f} passes over the pairs); "
                 f"kept step {self.best['step']} (select={self.opts.select}); model.safetensors {size / 1e6:.2f} MB "
                 f"-> {self.out}")
        if self.best["step"] == 0:
            self.say("warning: no fine-tuned checkpoint met the selection rule; the output is the base model")
        del self.optimizer, self.best_state, self.code_train, self.code_val
        self.model.cpu()
        _release(self.device)
        return size


def _options_json(opts: FinetuneOptions) -> dict[str, Any]:
    plain = asdict(opts)
    plain.update(out=str(opts.out), base=str(opts.base), questions=list(opts.questions))
    return plain
