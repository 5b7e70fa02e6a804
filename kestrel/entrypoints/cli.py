"""`kestrel serve | generate | chat | model-init | bench ...`: the command line, and the only reader of env vars."""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import importlib
import json
import os
import sys
import time
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kestrel.config import (
    ENGINE_ARGS,
    NOT_SUPPORTED_ENGINE_ARGS,
    ConfigError,
    engine_arg_default,
    engine_arg_type,
    field_kind,
)
from kestrel.entrypoints.server_config import NOT_SUPPORTED_SERVER_FLAGS, ServerConfig, chat_template_text
from kestrel.init_configs import ARCHS, SIZES
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import SamplingParams, SamplingParamsError

# Where the vLLM-only flags given are collected (flag name -> value), to reach the engine config with the rest.
VLLM_ONLY_DEST = "vllm_only_engine_args"
# Benchmark suites live in kestrel.bench.<name>; each module exposes register(subparsers).
BENCH_SUITES: tuple[str, ...] = ("gemm", "attention", "serve", "serve_plot", "ppl", "latency", "throughput",
                                   "step_budget", "quant_checkpoint", "structured",
                                   "spec_decode", "host_step", "allreduce", "soak", "moe", "cpu_throughput",
                                   "sparse_attention", "compression", "streaming", "multimodal", "whisper")


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags, one per ENGINE_ARGS entry (LLM's keyword with dashes, vLLM's name where it differs, and
    vLLM's short spellings); a flag left out leaves the config's own default."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="Hugging Face model directory (default: the bundled kestrel-tiny)")
    for arg in ENGINE_ARGS:
        vllm_flags = ["--" + arg.vllm_name.replace("_", "-")] if arg.vllm_name else []
        kind = token_count if arg.name in TOKEN_COUNT_ARGS else engine_arg_type(arg)
        _add_flag(group, ["--" + arg.name.replace("_", "-"), *vllm_flags, *arg.aliases], arg.name,
                  kind, engine_arg_default(arg), arg.help, arg.choices)
    # vLLM's flags that kestrel lacks reach the engine config like LLM(...)'s keywords, which accepts one at a value
    # that asks for nothing and refuses any other by name with the reason (not argparse's bare "unrecognized").
    server_fields = {f.name for f in dataclasses.fields(ServerConfig)}  # e.g. served_model_name: a server flag
    for name in NOT_SUPPORTED_ENGINE_ARGS.keys() - server_fields:
        group.add_argument("--" + name.replace("_", "-"), dest=name, nargs="?", const=True, type=_flag_value,
                           action=_VllmOnlyFlag, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


# Token counts given as vLLM's command line takes them: 32768, 32k (x 1000), 32K (x 1024), 25.6k.
TOKEN_COUNT_ARGS = frozenset({"max_model_len", "max_num_batched_tokens"})
_MULTIPLIERS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def token_count(text: str) -> int:
    """An integer, or a number with a suffix: k / m / g multiply by powers of 1000 (a decimal fraction allowed
    where the product is whole), K / M / G by powers of 1024."""
    value = text.strip()
    suffix = value[-1:] if value[-1:] in _MULTIPLIERS else ""
    number = value[:len(value) - len(suffix)]
    try:
        if suffix in ("", "K", "M", "G"):
            return int(number) * _MULTIPLIERS[suffix]
        scaled = decimal.Decimal(number) * _MULTIPLIERS[suffix] if "e" not in number.lower() else None
    except (ValueError, decimal.InvalidOperation):
        scaled = None
    if scaled is not None and scaled.is_finite() and scaled == scaled.to_integral_value():
        return int(scaled)
    raise argparse.ArgumentTypeError(f"invalid token count {text!r}: expected an integer, or a number with k, m, "
                                     "g (x 1000) or K, M, G (x 1024), such as 32768, 32k or 32K")


class _VllmOnlyFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = dict(getattr(namespace, VLLM_ONLY_DEST, {}))
        given[self.dest] = values
        setattr(namespace, VLLM_ONLY_DEST, given)


def _flag_value(text: str) -> Any:
    """A vLLM-only flag's value as LLM(...) would get it: JSON where it parses (0, false, null, {...}), else text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _add_flag(group: argparse._ArgumentGroup, flags: list[str], dest: str, kind: Any, default: Any,
              help_text: str, choices: Sequence[Any] | None = None) -> None:
    """One flag for a config field of type `kind`; left out, it leaves the field's own default (shown in the
    help). bool: --x / --no-x; tuple: one or more values; dict: a JSON object."""
    shown = help_text + (f" (default: {default})" if default not in (None, ()) else "")
    if kind is bool:
        group.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=shown)
    elif typing.get_origin(kind) is tuple:
        group.add_argument(*flags, dest=dest, nargs="+", default=argparse.SUPPRESS, help=shown)
    else:
        group.add_argument(*flags, dest=dest, type=_json_object if kind is dict else kind,
                           choices=[c for c in choices if c is not None] if choices else None,
                           default=argparse.SUPPRESS, help=shown)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {arg.name: getattr(args, arg.name) for arg in ENGINE_ARGS if hasattr(args, arg.name)}
    kwargs.update(getattr(args, VLLM_ONLY_DEST, {}))
    if "download_dir" not in kwargs:  # the Hugging Face cache variables, as huggingface_hub reads them
        hub = os.environ.get("HF_HUB_CACHE") or (os.path.join(os.environ["HF_HOME"], "hub")
                                                  if os.environ.get("HF_HOME") else None)
        if hub:
            kwargs["download_dir"] = hub
    return kwargs


# The sampling flags of `generate` and `chat`: (SamplingParams field, flag, help); a flag's value is
# args.<flag without dashes>. Types and defaults are SamplingParams', but for CLI_SAMPLING_OVERRIDES.
SAMPLING_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("max_tokens", "--max-tokens", "most tokens to generate per completion"),
    ("temperature", "--temperature", "0 means greedy"),
    ("top_p", "--top-p", "nucleus sampling: the smallest set of tokens with this much probability"),
    ("top_k", "--top-k", "sample among the k most likely tokens (0: all)"),
    ("min_p", "--min-p", "drop tokens less likely than this fraction of the most likely one"),
    ("repetition_penalty", "--repetition-penalty", "> 1 discourages tokens already in the prompt or output"),
    ("seed", "--sample-seed", "per-request sampling seed"),
    ("stop", "--stop", "stop string (repeatable)"),
    ("n", "-n", "completions per prompt"),
)
# Where the command line departs from SamplingParams() on purpose, with the reason its help gives: a run at the
# terminal answers the same each time, and at more length than the API's 16 tokens.
CLI_SAMPLING_OVERRIDES: dict[str, tuple[Any, str]] = {
    "temperature": (SamplingParams.GREEDY_TEMPERATURE, "greedy, the same answer each run"),
    "max_tokens": (64, "room for an answer at the terminal"),
}


def cli_sampling_defaults() -> dict[str, Any]:
    """The sampling settings of `generate` and `chat` when no flag is given."""
    defaults = {name: SamplingParams.default(name) for name, _, _ in SAMPLING_FLAGS}
    return {**defaults, **{name: value for name, (value, _) in CLI_SAMPLING_OVERRIDES.items()}}


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    defaults = cli_sampling_defaults()
    for name, flag, help_text in SAMPLING_FLAGS:
        default = defaults[name]
        if name in CLI_SAMPLING_OVERRIDES:
            shown = (f"{help_text} (default: {default}: {CLI_SAMPLING_OVERRIDES[name][1]}; SamplingParams() has "
                     f"{SamplingParams.default(name)})")
        else:
            shown = help_text + (f" (default: {default})" if default not in (None, []) else "")
        kind = field_kind(SamplingParams, name)
        if typing.get_origin(kind) is list:
            group.add_argument(flag, dest=_flag_dest(flag), action="append", type=typing.get_args(kind)[0],
                               default=default, help=shown)
        else:
            group.add_argument(flag, dest=_flag_dest(flag), type=kind, default=default, help=shown)


def _flag_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{name: getattr(args, _flag_dest(flag)) for name, flag, _ in SAMPLING_FLAGS})


def _cmd_generate(args: argparse.Namespace) -> int:
    from kestrel.entrypoints.llm import LLM

    params = _sampling_params(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise InvalidRequestError("prompt", "no prompt given; pass --prompt TEXT (repeatable) or lines on stdin")
    started = time.perf_counter()
    llm = LLM(args.model, **_engine_kwargs(args))
    loaded = time.perf_counter()
    if llm.config.debug_launch_count:
        print(f"[launches per decoder layer (decode step): {llm.runner.launches_per_layer}]", file=sys.stderr)
    outputs = llm.generate(prompts, params)
    done = time.perf_counter()
    generated = 0
    for output in outputs:
        for completion in output.outputs:
            generated += len(completion.token_ids)
            print(f"{output.prompt}{completion.text}")
            print(f"[finish_reason={completion.finish_reason}, tokens={len(completion.token_ids)}]")
    print(f"[load {loaded - started:.2f} s, generate {done - loaded:.2f} s, "
          f"{generated / max(done - loaded, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from kestrel.entrypoints.llm import LLM

    template = chat_template_text(args.chat_template)  # a bad one is refused before the model loads
    llm = LLM(args.model, **_engine_kwargs(args))
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = list(args.message) if args.message else None  # --message is repeatable: one turn each
    while True:
        if turns is not None:
            if not turns:
                return 0
            user = turns.pop(0)
        else:
            try:
                user = input("user> ")
            except EOFError:
                return 0
        messages.append({"role": "user", "content": user})
        reply = llm.chat(messages, params, use_tqdm=False, chat_template=template)[0].outputs[0].text
        print(f"assistant> {reply}")
        messages.append({"role": "assistant", "content": reply})


def _cmd_model_init(args: argparse.Namespace) -> int:
    from kestrel.loader.model_init import write_tiny_checkpoint

    if Path(args.path).exists() and not Path(args.path).is_dir():
        raise ConfigError(f"invalid path={args.path!r}: it is a file; give a directory for the checkpoint")
    write_tiny_checkpoint(args.path, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote a random {args.arch} checkpoint ({args.size}) to {args.path}")
    return 0


def _model_tokenizer(model: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"invalid model={model!r}: no tokenizer to encode calibration text ({e}); give "
                          "--calibration a JSONL file of {\"input_ids\": [...]} records") from None


def _calibration_samples(args: argparse.Namespace) -> list[list[int]]:
    """Token sequences of --seq-len tokens: from --calibration FILE (JSONL with "input_ids" or "text", else plain
    text), or the built-in set drawn from the kestrel-tiny training corpus."""
    from kestrel.tiny import corpus

    if args.calibration == "builtin":
        samples = corpus.calibration_token_ids(_model_tokenizer(args.model), args.num_samples, args.seq_len)
        if not samples:
            raise ConfigError("the built-in calibration set is empty on this machine; pass --calibration FILE")
        return samples
    path = Path(args.calibration)
    if not path.is_file():
        raise ConfigError(f"invalid calibration={args.calibration!r}: no such file; give a JSONL or text file "
                          "or 'builtin'")
    texts: list[str] = []
    ids: list[int] = []
    if path.suffix == ".jsonl":
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "input_ids" in record:
                ids.extend(int(t) for t in record["input_ids"])
            else:
                texts.append(record["text"])
    else:
        texts.append(path.read_text())
    # A file of token ids alone needs no tokenizer (a model directory may have none).
    tokenizer = _model_tokenizer(args.model) if texts else None
    samples = corpus.calibration_token_ids(tokenizer, args.num_samples, args.seq_len, texts, ids)
    if not samples:
        raise ConfigError(f"invalid calibration={args.calibration!r}: fewer than --seq-len={args.seq_len} tokens")
    return samples


def _cmd_quantize(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from kestrel.loader.hf_config import load_hf_config
    from kestrel.model.registry import model_skeleton
    from kestrel.quant.calibrate import WEIGHT_ONLY_FIELDS, QuantizeOptions, quantize_checkpoint

    weight_only = {name: getattr(args, name) for name in WEIGHT_ONLY_FIELDS if hasattr(args, name)}
    options = QuantizeOptions(args.scheme, args.smoothquant, args.kv_cache == "fp8", args.num_samples, args.seq_len,
                              args.weight_strategy, **weight_only)
    samples = _calibration_samples(args) if options.needs_calibration else None
    summary = quantize_checkpoint(args.model, args.out, options, samples, device=args.device,
                                  progress=lambda items: tqdm(items, desc="quantize", leave=False),
                                  model=model_skeleton(load_hf_config(args.model)), overwrite=args.overwrite)
    print(json.dumps(summary, indent=2))
    print(f"wrote a compressed-tensors {args.scheme} checkpoint to {args.out}; serve it with "
          f"`kestrel serve --model {args.out}`")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from kestrel.entrypoints.server import run_server

    config = _server_config(args)
    model = args.model
    if args.model_tag is not None:
        if model is not None and model != args.model_tag:
            raise ConfigError(f"two models given: {args.model_tag!r} and --model {model!r}; give one")
        model = args.model_tag
    if model is None:
        from kestrel.tiny import default_model_path

        model = str(default_model_path())
        if not config.served_model_name:
            config = dataclasses.replace(config, served_model_name=("kestrel-tiny",))
    return run_server(config, model, _engine_kwargs(args))


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server flags, one per ServerConfig field (its name with dashes; help and choices from its metadata)."""
    group = parser.add_argument_group("server")
    for f in dataclasses.fields(ServerConfig):
        flags = ["--" + f.name.replace("_", "-")]
        if f.metadata.get("json_list"):  # one value a flag (so a model after it stays the model), repeatable
            group.add_argument(*flags, dest=f.name, type=_json_list_or_one, action="extend",
                               default=argparse.SUPPRESS, help=f.metadata["help"] + f" (default: {list(f.default)})")
            continue
        _add_flag(group, flags, f.name, field_kind(ServerConfig, f.name), f.default, f.metadata["help"],
                  f.metadata.get("choices"))
    for name, reason in NOT_SUPPORTED_SERVER_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), nargs="?", action=_RefusedFlag, reason=reason,
                           help=argparse.SUPPRESS)


class _RefusedFlag(argparse.Action):
    """A `vllm serve` flag kestrel does not have: refused by name, with what to do instead."""

    def __init__(self, *args: Any, reason: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not supported: {self.reason}")


def _json_list_or_one(text: str) -> list[str]:
    """vLLM's JSON list of strings ('["a", "b"]'), or one plain value."""
    if not text.lstrip().startswith("["):
        return [text]
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list ({e})") from None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise argparse.ArgumentTypeError("expected a JSON list of strings")
    return values


def _server_config(args: argparse.Namespace) -> ServerConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    for name, value in given.items():
        if typing.get_origin(field_kind(ServerConfig, name)) is tuple:
            given[name] = tuple(value)
    # The key from the environment where no --api-key is given: kestrel's variable, else vLLM's (a deployment's
    # `export VLLM_API_KEY=...` must not leave the migrated server open).
    key = os.environ.get("KESTREL_API_KEY") or os.environ.get("VLLM_API_KEY")
    if not given.get("api_key") and key:
        given["api_key"] = (key,)
    return ServerConfig(**given)


def build_parser() -> argparse.ArgumentParser:
    parser = ExactFlagParser(prog="kestrel", description="Fast LLM inference and serving.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model directory, as `vllm serve MODEL` takes it (or --model)")
    _add_engine_args(serve)
    _add_serve_args(serve)
    serve.set_defaults(func=_cmd_serve)

    generate = commands.add_parser("generate", help="complete prompts offline")
    _add_engine_args(generate)
    _add_sampling_args(generate)
    generate.add_argument("--prompt", action="append", help="prompt text (repeatable); default: stdin lines")
    generate.set_defaults(func=_cmd_generate)

    chat = commands.add_parser("chat", help="chat with the model through its chat template")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--message", action="append", help="user turn (repeatable); default: interactive")
    chat.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one, in place "
                      "of the tokenizer's")
    chat.set_defaults(func=_cmd_chat)

    init = commands.add_parser("model-init", help="write a small random Hugging Face checkpoint with a tokenizer")
    init.add_argument("path")
    init.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    init.add_argument("--size", default="tiny", choices=sorted(SIZES))
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=_cmd_model_init)

    from kestrel.quant.calibrate import SCHEMES, WEIGHT_ONLY_FIELDS, QuantizeOptions

    quantize = commands.add_parser("quantize", help="write a compressed-tensors checkpoint: W8A8 (calibrated, "
                                   "optionally smoothed) or weight-only W4A16 / W8A16 (RTN, AWQ or GPTQ)")
    quantize.add_argument("model", help="Hugging Face model directory with float weights")
    quantize.add_argument("out", help="output directory")
    quantize.add_argument("--scheme", required=True, choices=list(SCHEMES))
    quantize.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA",
                          help="migrate activation outliers into the weights (alpha in [0, 1], e.g. 0.5)")
    quantize.add_argument("--kv-cache", default=None, choices=["fp8"], help="calibrate FP8 KV cache scales")
    quantize.add_argument("--calibration", default="builtin", help="JSONL / text file, or 'builtin' (the "
                          "kestrel-tiny corpus)")
    quantize.add_argument("--num-samples", type=int, default=64)
    quantize.add_argument("--seq-len", type=int, default=256)
    quantize.add_argument("--weight-strategy", default="channel", choices=["channel", "tensor"],
                          help="one weight scale per output channel (default) or per linear module")
    quantize.add_argument("--device", default="cpu", help="where the calibration forward runs")
    quantize.add_argument("--overwrite", action="store_true", help="write into a non-empty output directory, "
                          "replacing the checkpoint files in it (never the model's own directory)")
    weight_only = quantize.add_argument_group("weight-only schemes (w4a16, w8a16)")
    fields = {f.name: f for f in dataclasses.fields(QuantizeOptions)}
    for name in WEIGHT_ONLY_FIELDS:
        _add_flag(weight_only, ["--" + name.replace("_", "-")], name, field_kind(QuantizeOptions, name), None,
                  fields[name].metadata["help"], fields[name].metadata.get("choices"))
    quantize.set_defaults(func=_cmd_quantize)

    bench = commands.add_parser("bench", help="benchmark suites (GPU)")
    suites = bench.add_subparsers(dest="suite", required=True)
    for name in BENCH_SUITES:
        importlib.import_module(f"kestrel.bench.{name}").register(suites)
    return parser


class ExactFlagParser(argparse.ArgumentParser):
    """A parser (and, as their class, its subcommands' parsers) that takes flags whole: by argparse's default a
    vLLM flag kestrel lacks would be read as a longer flag of kestrel's that it begins (`--logprobs` as the
    refused `--logprobs-mode`, `--swap` as `--swap-space`), and refused with the wrong name or taken silently."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


# The commands whose flags a --config file may hold (the engine's, the server's, sampling).
CONFIG_COMMANDS = ("serve", "generate", "chat")


def expand_argv(argv: Sequence[str]) -> list[str]:
    """vLLM's command-line conveniences, read into plain flags: `--flag_name` spelled with underscores, and
    `--config FILE`, a YAML mapping of flag names (either spelling) to values, whose flags go right after the
    command so that the ones given on the command line win (true: the flag; false: its --no- form; a list: its
    values; a mapping: its JSON)."""
    argv = [("--" + a[2:].split("=", 1)[0].replace("_", "-") + ("=" + a.split("=", 1)[1] if "=" in a else ""))
            if a.startswith("--") and a != "--" else a for a in argv]
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command is None or argv[command] not in CONFIG_COMMANDS:
        raise ConfigError(f"--config reads flags of {' / '.join(CONFIG_COMMANDS)}; give it after one of them")
    rest, path = [], None
    i = command + 1
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            path, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    if path is None:
        raise ConfigError("--config needs a file: --config FILE.yaml")
    return argv[:command + 1] + _config_flags(path) + rest


_JSON_LIST_FLAGS = frozenset("--" + f.name.replace("_", "-") for f in dataclasses.fields(ServerConfig)
                             if f.metadata.get("json_list"))


def _config_flags(path: str) -> list[str]:
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except OSError as error:
        raise ConfigError(f"invalid --config={path!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"invalid --config={path!r}: not YAML ({error})") from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ConfigError(f"invalid --config={path!r}: expected a mapping of flag names to values")
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None:
            continue  # the flag's default
        if isinstance(value, bool) and _flag_dest(flag) in NOT_SUPPORTED_ENGINE_ARGS:
            flags += [flag, json.dumps(value)]  # vLLM-only: a value, which one that asks for nothing passes
        elif isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list) and flag in _JSON_LIST_FLAGS:
            flags += [flag, json.dumps(value)]
        elif isinstance(value, list):
            flags += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = expand_argv(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "bench" and getattr(args, "suite", None) == "serve" and not args.api_key:
        args.api_key = os.environ.get("OPENAI_API_KEY")  # as `vllm bench serve` reads it
    try:
        return int(args.func(args) or 0)
    except (ConfigError, InvalidRequestError, SamplingParamsError) as e:
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
