"""Training kestrel-tiny: tokenizer, packed data, AdamW with warmup + cosine, stop by wall clock, HF export.

`scripts/train_tiny.py` is the command line; tests call `train()` with a small `TrainOptions`.
Output (exactly the files the GPU machine can hand back): config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json, train_log.json, loss.png.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from kestrel.loader.tokenizer_init import BOS_TOKEN, EOS_TOKEN
from kestrel.tiny import corpus
from training.tiny.model import TinyConfig, TinyLlama, num_parameters, save_hf_model
from training.tiny.tokenizer import encode_documents, save_tokenizer, train_tokenizer

# About 1% of the train split (disjoint from the eval split, since 100 is a multiple of 20) is kept out
# of training to watch for overfitting and to pick the checkpoint; the eval split is never looked at.
VAL_MODULUS = 100
VAL_REMAINDER = 1
# Time kept back from --max-total-minutes for the last evaluation and the writes.
SAVE_RESERVE_S = 20.0
MAX_SAFETENSORS_BYTES = 16_000_000


@dataclass
class TrainOptions:
    out: Path
    minutes: float = 8.0
    steps: int | None = None
    max_total_minutes: float | None = None
    device: str = "auto"
    seed: int = 0
    model: TinyConfig = field(default_factory=TinyConfig)
    tokenizer_dir: Path | None = None
    max_train_files: int | None = None
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    dropout: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    log_every: int = 50
    val_tokens: int = 262_144
    save_dtype: str = "bfloat16"
    compile: bool = False
    plot: bool = True
    quiet: bool = False


@dataclass
class Data:
    train: torch.Tensor  # packed token stream, int64
    val: torch.Tensor  # [windows, context + 1]
    stats: dict[str, Any]


@dataclass
class TrainResult:
    out: Path
    num_parameters: int
    safetensors_bytes: int
    best_val_loss: float
    log: dict[str, Any]


# ------------------------------------------------------------------------------------------------ data


def split_files(max_train_files: int | None) -> tuple[list[corpus.SourceFile], list[corpus.SourceFile]]:
    """(train, val): the corpus's train split with the validation slice taken out."""
    files = corpus.train_files()
    val = [f for f in files if corpus.path_hash(f.rel) % VAL_MODULUS == VAL_REMAINDER]
    train = [f for f in files if corpus.path_hash(f.rel) % VAL_MODULUS != VAL_REMAINDER]
    if max_train_files is not None:
        train = corpus.select_evenly(train, max_train_files)
        val = corpus.select_evenly(val, max(2, max_train_files // 20))
    return train, val


def pack(docs: list[list[int]], bos_id: int, eos_id: int) -> torch.Tensor:
    """One stream: <bos> file <eos> <bos> file <eos> ...; windows are cut from it at random offsets."""
    out: list[int] = []
    for ids in docs:
        out.append(bos_id)
        out.extend(ids)
        out.append(eos_id)
    return torch.tensor(out, dtype=torch.long)


def val_windows(stream: torch.Tensor, context: int, max_tokens: int) -> torch.Tensor:
    count = max(1, min(len(stream) // (context + 1), max_tokens // context))
    return stream[: count * (context + 1)].view(count, context + 1)


def prepare_data(opts: TrainOptions, log: dict[str, Any]) -> tuple[Tokenizer, Data]:
    started = time.perf_counter()
    train_set, val_set = split_files(opts.max_train_files)
    train_texts, val_texts = corpus.texts(train_set), corpus.texts(val_set)
    listed = time.perf_counter()
    if opts.tokenizer_dir is not None:
        tokenizer = Tokenizer.from_file(str(Path(opts.tokenizer_dir) / "tokenizer.json"))
    else:
        tokenizer = train_tokenizer(train_texts, opts.model.vocab_size)
    trained = time.perf_counter()
    if tokenizer.get_vocab_size() > opts.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's "
                         f"vocab_size={opts.model.vocab_size}")
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    train_stream = pack(encode_documents(tokenizer, train_texts), bos, eos)
    val_stream = pack(encode_documents(tokenizer, val_texts), bos, eos)
    if len(train_stream) <= opts.model.max_position + 1:
        raise ValueError(f"only {len(train_stream)} training tokens; need more than the context "
                         f"{opts.model.max_position}")
    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    stats = {
        "python": platform.python_version(),
        "stdlib": str(corpus.stdlib_root()),
        "train_files": len(train_texts),
        "val_files": len(val_texts),
        "eval_files": len(corpus.eval_files()),
        "train_bytes": train_bytes,
        "train_tokens": len(train_stream),
        "val_tokens": len(val_stream),
        "bytes_per_token": train_bytes / max(1, len(train_stream) - 2 * len(train_texts)),
    }
    log["timing"].update(list_files_s=listed - started, tokenizer_s=trained - listed,
                         encode_s=time.perf_counter() - trained)
    return tokenizer, Data(train_stream, val_windows(val_stream, opts.model.max_position, opts.val_tokens), stats)


# ------------------------------------------------------------------------------------------------ optimization


def run_progress(step: int, steps: int | None, loop_start: float, budget_s: float,
                 deadline: float | None) -> float | None:
    """How far a run is, in [0, 1): by steps when a step count is set, else by wall clock; None once it is over
    (its steps, its time budget or the deadline)."""
    now = time.perf_counter()
    progress = step / steps if steps is not None else (now - loop_start) / budget_s
    return None if progress >= 1.0 or (deadline is not None and now >= deadline) else progress


def lr_at(opts: TrainOptions, step: int, progress: float) -> float:
    """Linear warmup over `warmup_steps`, times a cosine from 1 to `min_lr_ratio` over the run's progress
    (fraction of the step count, or of the wall-clock budget)."""
    warm = min(1.0, (step + 1) / max(1, opts.warmup_steps))
    cosine = opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return opts.lr * warm * cosine


def make_optimizer(model: TinyLlama, opts: TrainOptions, device: torch.device) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opts.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def sample_batch(stream: torch.Tensor, batch_size: int, context: int, generator: torch.Generator,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.randint(0, len(stream) - context - 1, (batch_size,), generator=generator)
    rows = (offsets[:, None] + torch.arange(context + 1)).to(device, non_blocking=True)
    chunk = stream[rows]
    return chunk[:, :-1], chunk[:, 1:]


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)


@torch.no_grad()
def evaluate(model: TinyLlama, windows: torch.Tensor, device: torch.device, batch_size: int) -> float:
    """Mean next-token loss (nats) over the validation windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start: start + batch_size]
        with autocast(device):
            loss = model.loss(chunk[:, :-1], chunk[:, 1:])
        n = chunk[:, 1:].numel()
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / max(1, count)


# ------------------------------------------------------------------------------------------------ the run


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    return torch.device(name)


def train(opts: TrainOptions) -> TrainResult:
    """Prepare the data, train until the step count or the wall-clock budget is used, write the directory."""
    script_start = time.perf_counter()
    device = resolve_device(opts.device)
    torch.manual_seed(opts.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    log: dict[str, Any] = {"options": _options_json(opts), "timing": {}, "train": [], "val": [],
                           "environment": _environment(device)}
    run = _Run(opts, device, out, log, script_start)
    run.prepare()
    run.loop()
    return run.finish()


class _Run:
    """One training run: its data, model, optimizer, log and best checkpoint."""

    def __init__(self, opts: TrainOptions, device: torch.device, out: Path, log: dict[str, Any],
                 script_start: float) -> None:
        self.opts, self.device, self.out, self.log = opts, device, out, log
        self.script_start = script_start
        self.say = (lambda _msg: None) if opts.quiet else (lambda msg: print(msg, flush=True))
        self.best: dict[str, float] = {"val_loss": math.inf, "step": -1}
        self.best_state: dict[str, torch.Tensor] = {}
        self.step = self.tokens = 0
        self.loop_s = 0.0

    def prepare(self) -> None:
        opts = self.opts
        tokenizer, data = prepare_data(opts, self.log)
        save_tokenizer(tokenizer, self.out)
        self.bos, self.eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
        self.stats = self.log["corpus"] = data.stats
        self.say(f"corpus: {data.stats['train_files']} train files, {data.stats['train_tokens']:,} tokens "
                 f"({data.stats['bytes_per_token']:.2f} bytes/token); val {data.stats['val_tokens']:,} tokens; "
                 f"prep {time.perf_counter() - self.script_start:.1f} s")
        self.model = TinyLlama(opts.model, dropout=opts.dropout).to(self.device)
        self.log["model"] = asdict(opts.model)
        self.log["num_parameters"] = num_parameters(self.model)
        self.say(f"model: {self.log['num_parameters']:,} parameters on {self.device}")
        self.step_fn = torch.compile(self.model.loss) if opts.compile else self.model.loss
        self.optimizer = make_optimizer(self.model, opts, self.device)
        self.train_stream = data.train.to(self.device)
        self.val = data.val.to(self.device)
        self.generator = torch.Generator().manual_seed(opts.seed)

    def loop(self) -> None:
        opts = self.opts
        loop_start = time.perf_counter()
        budget_s = opts.minutes * 60.0
        deadline = (None if opts.max_total_minutes is None
                    else self.script_start + opts.max_total_minutes * 60 - SAVE_RESERVE_S)
        if deadline is not None:
            # The cosine spans the time actually left, so a slow preparation shortens the run, not the decay.
            budget_s = max(1.0, min(budget_s, deadline - loop_start))
        self.log["timing"]["train_budget_s"] = budget_s
        running: torch.Tensor | float = 0.0
        self.model.train()
        while (progress := run_progress(self.step, opts.steps, loop_start, budget_s, deadline)) is not None:
            lr = lr_at(opts, self.step, progress)
            running = running + self._train_step(lr)
            if self.step % opts.log_every == 0:
                self._log_train(float(running) / opts.log_every, lr, time.perf_counter() - loop_start)
                running = 0.0
            if self.step % opts.eval_every == 0:
                self._evaluate_and_keep(time.perf_counter() - loop_start)
        self.loop_s = time.perf_counter() - loop_start

    def _train_step(self, lr: float) -> torch.Tensor:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = sample_batch(self.train_stream, self.opts.batch_size, self.opts.model.max_position,
                                       self.generator, self.device)
        with autocast(self.device):
            loss = self.step_fn(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.opts.grad_clip)
        self.optimizer.step()
        self.step += 1
        self.tokens += inputs.numel()
        return loss.detach()  # summed on the device; read back only when logged

    def _log_train(self, loss: float, lr: float, elapsed: float) -> None:
        self.log["train"].append({"step": self.step, "tokens": self.tokens, "seconds": round(elapsed, 2), "lr": lr,
                                  "loss": loss})
        self.say(f"step {self.step:6d}  loss {loss:.4f}  lr {lr:.2e}  {self.tokens / elapsed:,.0f} tok/s  "
                 f"{elapsed:.0f} s")

    def _evaluate_and_keep(self, elapsed: float) -> float:
        val_loss = evaluate(self.model, self.val, self.device, self.opts.batch_size)
        self.log["val"].append({"step": self.step, "tokens": self.tokens, "seconds": round(elapsed, 2),
                                "loss": val_loss})
        self.say(f"step {self.step:6d}  val {val_loss:.4f}")
        if val_loss < self.best["val_loss"]:
            self.best = {"val_loss": val_loss, "step": self.step}
            self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            # Written as it goes: a run killed by an outside time limit still leaves a usable model.
            save_hf_model(self.model, self.out, self.bos, self.eos, self.opts.save_dtype)
        _write_json(self.out / "train_log.json", self.log)
        return val_loss

    def finish(self) -> TrainResult:
        opts, log = self.opts, self.log
        best_before = self.best["val_loss"]
        final_loss = self._evaluate_and_keep(self.loop_s)
        if final_loss >= best_before:
            self.model.load_state_dict(self.best_state)
        size = save_hf_model(self.model, self.out, self.bos, self.eos, opts.save_dtype)
        saved_loss = _saved_dtype_loss(self.model, self.val, self.device, opts)
        log.update(steps=self.step, tokens=self.tokens, epochs=self.tokens / max(1, self.stats["train_tokens"]),
                   best=self.best, val_loss_saved_dtype=saved_loss, safetensors_bytes=size,
                   save_dtype=opts.save_dtype)
        log["timing"].update(train_loop_s=self.loop_s, total_s=time.perf_counter() - self.script_start)
        _write_json(self.out / "train_log.json", log)
        if opts.plot:
            plot_loss(log, self.out / "loss.png")
        self.say(f"done: {self.step} steps, {self.tokens:,} tokens ({log['epochs']:.1f} epochs) in "
                 f"{self.loop_s:.0f} s; best val {self.best['val_loss']:.4f} at step {self.best['step']}, "
                 f"{saved_loss:.4f} in {opts.save_dtype}; model.safetensors {size / 1e6:.2f} MB -> {self.out}")
        if size > MAX_SAFETENSORS_BYTES:
            self.say(f"warning: model.safetensors is {size:,} bytes, over the {MAX_SAFETENSORS_BYTES:,} limit")
        return TrainResult(self.out, log["num_parameters"], size, self.best["val_loss"], log)


def _saved_dtype_loss(model: TinyLlama, val: torch.Tensor, device: torch.device, opts: TrainOptions) -> float:
    """Validation loss of the weights as stored (rounded to save_dtype), evaluated like the others."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[opts.save_dtype]
    rounded = TinyLlama(opts.model).to(device)
    rounded.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
    return evaluate(rounded, val, device, opts.batch_size)


def plot_loss(log: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no loss.png", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if log["train"]:
        ax.plot([r["tokens"] / 1e6 for r in log["train"]], [r["loss"] for r in log["train"]], label="train")
    if log["val"]:
        ax.plot([r["tokens"] / 1e6 for r in log["val"]], [r["loss"] for r in log["val"]], "o-", ms=3,
                label="validation")
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"kestrel-tiny: {log['num_parameters'] / 1e6:.2f}M parameters, {log['steps']} steps, "
                 f"{log['timing']['train_loop_s'] / 60:.1f} min on {log['environment']['device_name']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _environment(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": device.type, "device_name": name, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def _options_json(opts: TrainOptions) -> dict[str, Any]:
    plain = asdict(replace(opts, out=str(opts.out),
                           tokenizer_dir=None if opts.tokenizer_dir is None else str(opts.tokenizer_dir)))
    plain.pop("model")
    return plain


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
