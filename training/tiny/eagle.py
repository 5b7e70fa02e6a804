"""Draft proposers for kestrel-tiny, trained on its own outputs: an EAGLE-style head and a 2-layer draft model.

The head (what `kestrel.model.eagle.EagleHead` serves): at position p it reads token t_p and the target's hidden
state at p - 1 (after its final norm; zeros at position 0), projects [embedding; feature] with `fc`, runs one
decoder layer and a final norm, and predicts the target's hidden state at p, scored by the target's (frozen,
shared) LM head. Loss: KL from the target's next-token distribution at p plus a smooth-L1 regression to its hidden
state; the features get a little noise, since while drafting the head reads its own (imperfect) outputs.

The draft model: kestrel-tiny's embedding, first `draft_layers` layers and final norm (tied head), distilled
(KL to the target's distribution) on the same corpus.

Held-out acceptance (the number that matters): at positions of the held-out split, the proposer drafts k tokens
greedily from the prefix, the target's greedy continuation checks them, and the accepted count is the length of
the matching prefix, exactly as greedy verification in the engine counts it.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn

from kestrel.loader.model_init import write_eagle_head
from kestrel.loader.tokenizer_init import BOS_TOKEN, EOS_TOKEN
from kestrel.tiny import corpus
from training.tiny.model import DecoderLayer, RMSNorm, TinyConfig, TinyLlama, rope_tables, save_hf_model
from training.tiny.tokenizer import encode_documents
from training.tiny.train import autocast, pack, resolve_device, sample_batch, split_files

KINDS = ("eagle", "draft")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class DraftTrainOptions:
    target: Path
    out: Path
    kind: str = "eagle"  # "eagle" (a head) or "draft" (a small draft model)
    steps: int = 2000
    minutes: float = 3.0  # wall-clock cap of the training loop
    device: str = "auto"
    seed: int = 0
    batch_size: int = 32
    context: int = 256
    lr: float = 2e-3
    warmup_steps: int = 50
    feature_noise: float = 0.05  # EAGLE: uniform noise on the input features, times their RMS
    regression_weight: float = 1.0  # EAGLE: smooth-L1 feature loss next to the KL
    draft_layers: int = 2  # draft model: layers kept from the target
    max_train_files: int | None = 600
    max_eval_files: int = 40
    eval_positions: int = 256
    eval_prefix: int = 128
    num_speculative_tokens: int = 5
    log_every: int = 50


# ------------------------------------------------------------------------------------------------ models


def load_target(path: Path, device: torch.device) -> TinyLlama:
    """kestrel-tiny (or any checkpoint of its family) as the training-side network, frozen, float32."""
    hf = json.loads((path / "config.json").read_text())
    cfg = TinyConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                     intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
                     num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                     max_position=hf["max_position_embeddings"], rope_theta=hf.get("rope_theta", 10000.0),
                     rms_norm_eps=hf["rms_norm_eps"], tie_word_embeddings=hf.get("tie_word_embeddings", True))
    model = TinyLlama(cfg)
    state = {name: t.float() for name, t in load_file(str(path / "model.safetensors")).items()}
    model.load_state_dict(state)
    return model.to(device).eval().requires_grad_(False)


def target_hidden(model: TinyLlama, ids: torch.Tensor) -> torch.Tensor:
    """The target's last hidden states [B, T, H], after its final norm (what its LM head reads)."""
    cos, sin = rope_tables(model.cfg, ids.shape[1], ids.device)
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        x = layer(x, cos, sin, 0.0)
    return model.model.norm(x)


class _HeadBody(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyEagleHead(nn.Module):
    """Parameter names are the checkpoint's (`fc.weight`, `model.layers.0.*`, `model.norm.weight`)."""

    def __init__(self, cfg: TinyConfig, target: TinyLlama) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.model = _HeadBody(cfg)
        # The layer starts as the target's last one, and fc as "take the feature": a head that begins near the
        # target's own top layer learns in minutes.
        self.model.layers[0].load_state_dict(target.model.layers[-1].state_dict())
        self.model.norm.load_state_dict(target.model.norm.state_dict())
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, cfg.hidden_size:] = torch.eye(cfg.hidden_size)
            self.fc.weight[:, : cfg.hidden_size] = torch.eye(cfg.hidden_size) * 0.1
        self.target = [target]  # not a submodule: shared, frozen, not saved

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        target = self.target[0]
        cos, sin = rope_tables(self.cfg, ids.shape[1], ids.device)
        x = self.fc(torch.cat([target.model.embed_tokens(ids), features], dim=-1))
        return self.model.norm(self.model.layers[0](x, cos, sin, 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.target[0].head_weight())


def shifted_features(hidden: torch.Tensor) -> torch.Tensor:
    """Position p reads the hidden state at p - 1; position 0 reads zeros (as the engine does)."""
    return torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)


def init_draft_model(target: TinyLlama, num_layers: int) -> TinyLlama:
    cfg = TinyConfig(**{**asdict(target.cfg), "num_layers": num_layers})
    draft = TinyLlama(cfg)
    state = {name: t for name, t in target.state_dict().items()
             if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    draft.load_state_dict(state)
    return draft


# ------------------------------------------------------------------------------------------------ acceptance


@torch.no_grad()
def greedy_continuation(model: TinyLlama, prefix: torch.Tensor, k: int) -> torch.Tensor:
    ids = prefix
    for _ in range(k):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prefix.shape[1]:]


@torch.no_grad()
def eagle_drafts(head: TinyEagleHead, target: TinyLlama, prefix: torch.Tensor, k: int) -> torch.Tensor:
    """k greedy drafts: the head over the prefix (the target's features), then over its own outputs."""
    ids, features = prefix, shifted_features(target_hidden(target, prefix))
    drafts = []
    for _ in range(k):
        out = head(ids, features)
        drafts.append(head.logits(out[:, -1]).argmax(-1, keepdim=True))
        ids = torch.cat([ids, drafts[-1]], dim=1)
        features = torch.cat([features, out[:, -1:]], dim=1)
    return torch.cat(drafts, dim=1)


def accepted_lengths(drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Leading drafts equal to the target's greedy tokens, per row (greedy verification's count)."""
    return (drafts == target_tokens).long().cumprod(dim=1).sum(dim=1)


def acceptance_report(accepted: torch.Tensor, k: int) -> dict[str, Any]:
    accepted = accepted.float()
    return {
        "num_speculative_tokens": k,
        "positions": int(accepted.numel()),
        "mean_accepted_tokens": float(accepted.mean()),
        # Tokens per target step: the accepted drafts plus the one the target adds.
        "mean_accepted_length": float(accepted.mean() + 1),
        "per_position_acceptance": [float((accepted >= j).float().mean()) for j in range(1, k + 1)],
    }


def eval_prefixes(stream: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, max(1, len(stream) - length), (count,), generator=g)
    return stream[offsets[:, None] + torch.arange(length)]


@torch.no_grad()
def held_out_acceptance(opts: DraftTrainOptions, target: TinyLlama, proposer: nn.Module, prefixes: torch.Tensor,
                        device: torch.device) -> dict[str, Any]:
    k = opts.num_speculative_tokens
    accepted = []
    for start in range(0, len(prefixes), 64):
        prefix = prefixes[start: start + 64].to(device)
        expected = greedy_continuation(target, prefix, k)
        drafts = (eagle_drafts(proposer, target, prefix, k) if opts.kind == "eagle"
                  else greedy_continuation(proposer, prefix, k))
        accepted.append(accepted_lengths(drafts, expected).cpu())
    return acceptance_report(torch.cat(accepted), k)


# ------------------------------------------------------------------------------------------------ training


def load_streams(opts: DraftTrainOptions) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = Tokenizer.from_file(str(opts.target / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    train_files, _ = split_files(opts.max_train_files)
    held_out = corpus.select_evenly(corpus.eval_files(), opts.max_eval_files)
    train = pack(encode_documents(tokenizer, corpus.texts(train_files)), bos, eos)
    held = pack(encode_documents(tokenizer, corpus.texts(held_out)), bos, eos)
    return train, held


def distill_loss(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(target || proposer) over every position, in nats per token."""
    return F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(target_logits.float(), -1), log_target=True,
                    reduction="batchmean")


def train_draft(opts: DraftTrainOptions) -> dict[str, Any]:
    """Train the proposer, write its directory under `opts.out` and `train_log.json`; returns the log."""
    if opts.kind not in KINDS:
        raise ValueError(f"kind={opts.kind!r}: expected one of {KINDS}")
    started = time.perf_counter()
    device = resolve_device(opts.device)
    torch.manual_seed(opts.seed)
    target = load_target(opts.target, device)
    train, held = load_streams(opts)
    train = train.to(device)  # sample_batch indexes it with device rows
    prefixes = eval_prefixes(held, opts.eval_positions, min(opts.eval_prefix, target.cfg.max_position - 16), opts.seed)
    proposer: nn.Module = (TinyEagleHead(target.cfg, target) if opts.kind == "eagle"
                           else init_draft_model(target, opts.draft_layers)).to(device)
    log: dict[str, Any] = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
                           "device": str(device), "train_tokens": len(train), "held_out_tokens": len(held),
                           "train": []}
    log["acceptance_before"] = held_out_acceptance(opts, target, proposer, prefixes, device)
    params = [p for p in proposer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(opts.seed)
    context = min(opts.context, target.cfg.max_position)
    loop_start = time.perf_counter()
    step = 0
    proposer.train()
    while step < opts.steps and time.perf_counter() - loop_start < opts.minutes * 60:
        progress = max(step / max(opts.steps, 1), (time.perf_counter() - loop_start) / (opts.minutes * 60))
        lr = opts.lr * min(1.0, (step + 1) / opts.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, _ = sample_batch(train, opts.batch_size, context, generator, device)
        with autocast(device):
            loss, parts = _loss(opts, proposer, target, ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % opts.log_every == 0:
            log["train"].append({"step": step, "lr": lr, "loss": float(loss.detach()), **parts,
                                 "elapsed_s": time.perf_counter() - loop_start})
        step += 1
    proposer.eval()
    log["steps"] = step
    log["train_seconds"] = time.perf_counter() - loop_start
    log["acceptance"] = held_out_acceptance(opts, target, proposer, prefixes, device)
    _save(opts, proposer, target)
    log["total_seconds"] = time.perf_counter() - started
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return log


def _loss(opts: DraftTrainOptions, proposer: nn.Module, target: TinyLlama,
          ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    with torch.no_grad():
        hidden = target_hidden(target, ids)
        target_logits = F.linear(hidden, target.head_weight())
    if opts.kind == "draft":
        kl = distill_loss(proposer(ids).flatten(0, 1), target_logits.flatten(0, 1))
        return kl, {"kl": float(kl.detach())}
    features = shifted_features(hidden)
    if opts.feature_noise:
        scale = features.float().pow(2).mean(-1, keepdim=True).sqrt()
        features = features + (torch.rand_like(features) * 2 - 1) * opts.feature_noise * scale.to(features.dtype)
    out = proposer(ids, features)
    kl = distill_loss(proposer.logits(out).flatten(0, 1), target_logits.flatten(0, 1))
    regression = F.smooth_l1_loss(out.float(), hidden.float())
    parts = {"kl": float(kl.detach()), "regression": float(regression.detach())}
    return kl + opts.regression_weight * regression, parts


def _save(opts: DraftTrainOptions, proposer: nn.Module, target: TinyLlama) -> None:
    target_config = json.loads((opts.target / "config.json").read_text())
    if opts.kind == "eagle":
        tensors = {name: t.detach().to("cpu", torch.bfloat16) for name, t in proposer.state_dict().items()}
        write_eagle_head(opts.out, {**target_config, "torch_dtype": "bfloat16"}, tensors=tensors)
        return
    hf = target_config
    save_hf_model(proposer, opts.out, hf["bos_token_id"], hf["eos_token_id"], dtype="bfloat16")
    for name in _TOKENIZER_FILES:
        if (opts.target / name).is_file():
            shutil.copy(opts.target / name, opts.out / name)
