"""`kestrel bench soak`: normal clients beside a stream of hostile requests, against a running server.

Normal clients stream completions at a fixed concurrency (random token-id prompts, as `kestrel bench serve`)
while attackers cycle through requests that once froze a server (ATTACKS: a huge grammar enum, thousands of
schema properties or choices, a multi-megabyte /tokenize, a response whose logprobs would run to megabytes, a
megabyte prompt) and a poller reads /health. With `--baseline` the same clients first run alone for as long, and
the normal clients' TTFT p99 under attack is compared with theirs alone.

A run passes when no request got a 5xx, none was lost (no answer, or a stream without [DONE]), every attack got
one of the statuses it may get, and the TTFT p99 ratio is within `--max-ttft-ratio`. JSON + PNG under
`--result-dir`; exit 0 on a pass, 1 on a failure, 2 when the server cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from kestrel.bench import serve

HEALTH_INTERVAL_S = 0.1
ATTACK_PAUSE_S = 0.5


@dataclass(frozen=True)
class Attack:
    path: str
    body: Callable[[str], dict[str, Any]]  # the served model's name -> the JSON body
    expect: frozenset[int]  # the statuses a defended server answers with


def _enum_body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "x", "max_tokens": 8,
            "structured_outputs": {"json": {"type": "string", "enum": [f"v{i:06d}" for i in range(100_000)]}}}


def _properties_body(model: str) -> dict[str, Any]:
    names = [f"p{i}" for i in range(5000)]
    schema = {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names}
    return {"model": model, "prompt": "x", "max_tokens": 8, "structured_outputs": {"json": schema}}


def _choice_body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "x", "max_tokens": 8,
            "structured_outputs": {"choice": [f"option {i}" for i in range(50_000)]}}


def _tokenize_body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "def foo(x): return x\n" * 180_000}


def _logprobs_body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
            "n": 16, "max_tokens": 512, "ignore_eos": True}


def _long_prompt_body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "lorem ipsum " * 90_000, "max_tokens": 1}


BAD_REQUEST = frozenset({400})
ATTACKS: dict[str, Attack] = {
    "enum_100k": Attack("/v1/completions", _enum_body, BAD_REQUEST),
    "schema_5000_properties": Attack("/v1/completions", _properties_body, BAD_REQUEST),
    "choice_50000": Attack("/v1/completions", _choice_body, BAD_REQUEST),
    "tokenize_3_8mb": Attack("/tokenize", _tokenize_body, frozenset({200, 400})),
    "logprobs_n16_top20": Attack("/v1/chat/completions", _logprobs_body, BAD_REQUEST),
    "prompt_1mb": Attack("/v1/completions", _long_prompt_body, frozenset({200, 400})),
}


@dataclass
class Phase:
    """What one phase saw."""

    records: list[serve.RequestRecord] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    health_failures: int = 0
    attacks: list[dict[str, Any]] = field(default_factory=list)
    started: float = 0.0
    duration_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        server_errors = sum(1 for r in self.records if r.status is not None and r.status >= 500)
        lost_records = [r for r in self.records if not r.success and (r.status is None or r.status == 200)]
        lost_attacks = [a for a in self.attacks if a["status"] is None]
        # Why each lost request was lost (a transport error, a stream cut before [DONE], an error event in a
        # stream), so that a failed run says what to look for: clipped error text -> count.
        lost_errors = Counter(f"status {r.status}: {r.error}" for r in lost_records)
        lost_errors.update(f"attack {a['name']}: {a['error']}" for a in lost_attacks)
        ttft = [r.chunk_times[0] - r.start for r in self.records if r.success]
        unexpected = [a for a in self.attacks if not a["expected"]]
        return {
            "duration_s": self.duration_s,
            "requests": len(self.records),
            "completed": sum(1 for r in self.records if r.success),
            "server_errors": server_errors + sum(1 for a in self.attacks if (a["status"] or 0) >= 500),
            "lost": len(lost_records) + len(lost_attacks),
            "lost_errors": dict(lost_errors.most_common(10)),
            "other_failures": dict(Counter(r.error for r in self.records  # 4xx: the lost ones are above
                                           if not r.success and r.status is not None and 200 < r.status < 500)),
            "ttft_ms": serve.summarize_ms(ttft),
            "health_ms": serve.summarize_ms(self.health_s),
            "health_failures": self.health_failures,
            "attacks": {name: dict(Counter(str(a["status"]) for a in self.attacks if a["name"] == name))
                        for name in sorted({a["name"] for a in self.attacks})},
            "attack_seconds_max": max((a["seconds"] for a in self.attacks), default=None),
            "unexpected_attack_answers": unexpected[:20],
        }


async def _normal_client(client: httpx.AsyncClient, target: serve.Target, phase: Phase, prompts: list[list[int]],
                         max_tokens: int, deadline: float, offset: int) -> None:
    index = offset
    while time.perf_counter() < deadline:
        record = await serve.send_request(client, target, index, prompts[index % len(prompts)], max_tokens, True)
        phase.records.append(record)
        index += 1


async def _attacker(client: httpx.AsyncClient, target: serve.Target, phase: Phase, names: list[str],
                    bodies: dict[str, bytes], deadline: float, offset: int) -> None:
    turn = offset
    headers = {**target.headers, "Content-Type": "application/json"}
    while time.perf_counter() < deadline:
        name = names[turn % len(names)]
        turn += 1
        attack = ATTACKS[name]
        started = time.perf_counter()
        status: int | None
        try:
            response = await client.post(f"{target.base_url}{attack.path}", content=bodies[name], headers=headers)
            status = response.status_code
            error = None
        except httpx.HTTPError as e:
            status, error = None, f"{type(e).__name__}: {e}"[:serve.ERROR_TEXT_LIMIT]
        phase.attacks.append({"name": name, "status": status, "seconds": time.perf_counter() - started,
                              "expected": status in attack.expect, "error": error})
        await asyncio.sleep(ATTACK_PAUSE_S)


async def _health_poller(client: httpx.AsyncClient, base_url: str, phase: Phase, deadline: float) -> None:
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        try:
            ok = (await client.get(f"{base_url}/health")).status_code == 200
        except httpx.HTTPError:
            ok = False
        phase.health_s.append(time.perf_counter() - started)
        phase.health_failures += not ok
        await asyncio.sleep(HEALTH_INTERVAL_S)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, parents first (Linux /proc); a process that ends during the walk is passed over
    with what it had started."""
    found: list[int] = []
    pending, seen = [pid], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        found.append(current)
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return found


def _rss_by_process(pid: int | None) -> dict[str, float] | None:
    """The resident memory of a process and of each descendant (tokenizer and grammar workers), in MB (Linux):
    "pid command" -> MB."""
    if pid is None:
        return None
    found: dict[str, float] = {}
    for current in process_tree(pid):
        try:
            with open(f"/proc/{current}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            found[f"{current} {fields['Name'].strip()}"] = int(fields.get("VmRSS", "0 kB").split()[0]) / 1024
        except (OSError, ValueError, KeyError):
            if current == pid:
                return None
    return found


def _rss_mb(by_process: dict[str, float] | None) -> float | None:
    return None if by_process is None else sum(by_process.values())


async def run_phase(target: serve.Target, args: argparse.Namespace, attacks: list[str],
                    bodies: dict[str, bytes]) -> Phase:
    phase = Phase()
    prompts = serve.make_prompts(max(args.clients * 4, 64), args.input_len, (10, 1000), args.seed)
    phase.started = time.perf_counter()
    deadline = phase.started + args.duration
    async with serve.make_client(args.clients + len(attacks) + 2, args.timeout) as client, \
            serve.make_client(2, args.timeout) as prober:
        tasks = [_normal_client(client, target, phase, prompts, args.max_tokens, deadline, i * 1000)
                 for i in range(args.clients)]
        tasks += [_attacker(client, target, phase, attacks, bodies, deadline, i) for i in range(args.attackers)
                  if attacks]
        tasks.append(_health_poller(prober, target.base_url, phase, deadline))
        await asyncio.gather(*tasks)
    phase.duration_s = time.perf_counter() - phase.started
    return phase


def verdict(phases: dict[str, dict[str, Any]], max_ttft_ratio: float) -> tuple[bool, list[str], float | None]:
    problems = []
    for name, summary in phases.items():
        for key in ("server_errors", "lost", "health_failures"):
            if summary[key]:
                problems.append(f"{name}: {summary[key]} {key.replace('_', ' ')}"
                                + (f" ({summary['lost_errors']})" if key == "lost" and summary.get("lost_errors")
                                   else ""))
        if summary["unexpected_attack_answers"]:
            problems.append(f"{name}: attacks answered unexpectedly: {summary['unexpected_attack_answers'][:3]}")
        if not summary["completed"]:
            problems.append(f"{name}: no normal request completed")
    ratio = None
    if "baseline" in phases and phases["baseline"]["ttft_ms"]["p99"] and phases["attack"]["ttft_ms"]["p99"]:
        ratio = phases["attack"]["ttft_ms"]["p99"] / phases["baseline"]["ttft_ms"]["p99"]
        if ratio > max_ttft_ratio:
            problems.append(f"normal clients' TTFT p99 under attack is {ratio:.2f}x theirs alone (limit "
                            f"{max_ttft_ratio:g}x)")
    return not problems, problems, ratio


def plot(doc: dict[str, Any], path: Path) -> bool:
    """TTFT percentiles and /health latency per phase, and the attack answers; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    phases = doc["phases"]
    names = list(phases)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "normal clients' TTFT (ms)"), (axes[1], "health_ms", "/health (ms)")):
        for offset, stat in enumerate(("median", "p99")):
            ax.bar([i + offset * 0.4 for i in range(len(names))], [phases[n][key][stat] or 0 for n in names], 0.4,
                   label=stat)
        ax.set_xticks([i + 0.2 for i in range(len(names))], names)
        ax.set_title(title)
        ax.legend(fontsize=8)
    attack = phases.get("attack", {}).get("attacks", {})
    labels = [f"{name}\n{status}" for name, counts in attack.items() for status in counts]
    axes[2].barh(labels, [c for counts in attack.values() for c in counts.values()], color="tab:red")
    axes[2].set_title("attack answers (count by status)")
    axes[2].tick_params(axis="y", labelsize=7)
    fig.suptitle(f"kestrel bench soak: {doc['config']['clients']} clients, {doc['config']['duration_s']:g} s a "
                 f"phase, {'pass' if doc['passed'] else 'FAIL'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of each phase")
    p.add_argument("--clients", type=int, default=64, help="normal clients, each with one request in flight")
    p.add_argument("--attackers", type=int, default=2, help="clients cycling through the attacks")
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma list of {', '.join(ATTACKS)}")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of a normal request")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens of a normal request")
    p.add_argument("--baseline", action="store_true", help="first run the normal clients alone, as long")
    p.add_argument("--max-ttft-ratio", type=float, default=2.0,
                   help="fail when the TTFT p99 under attack exceeds the baseline's by more")
    p.add_argument("--timeout", type=float, default=120.0, help="per request (s): beyond, the request is lost")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's pid on this machine: its RSS (workers included) is recorded idle, after "
                        "the baseline phase (the start of the growth counted) and at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--result-file", type=Path, default=None)


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("soak", help="normal clients beside hostile requests (HTTP)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _check(args: argparse.Namespace) -> list[str]:
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attacks {unknown}; known: {list(ATTACKS)}")
    for name in ("duration", "timeout", "max_ttft_ratio"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    for name in ("clients", "input_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.attackers < 0:
        raise ValueError("--attackers must be >= 0")
    return attacks


def run(args: argparse.Namespace) -> int:
    try:
        attacks = _check(args)
    except ValueError as e:
        print(f"kestrel bench soak: error: {e}", file=sys.stderr)
        return 2
    base_url = serve.normalize_base_url(args.base_url)
    headers = serve.auth_headers(args.api_key)
    try:
        model = args.model or asyncio.run(serve.resolve_model(base_url, headers, args.timeout))
    except (httpx.HTTPError, RuntimeError, KeyError) as e:
        print(f"kestrel bench soak: error: cannot query {base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    target = serve.Target(base_url, model, headers)
    bodies = {name: json.dumps(ATTACKS[name].body(model)).encode() for name in attacks}
    rss_idle = rss_start = _rss_by_process(args.server_pid)
    phases: dict[str, dict[str, Any]] = {}
    if args.baseline:
        phases["baseline"] = asyncio.run(run_phase(target, args, [], bodies)).summary()
        print(f"baseline: {json.dumps(phases['baseline'])}", flush=True)
        # Growth is counted from the server warmed by the same clients: what the attacks add, not the heap's
        # first high-water mark under load (a CPU engine keeps freed heap for reuse: worker/cpu_runtime.py).
        rss_start = _rss_by_process(args.server_pid)
    phases["attack"] = asyncio.run(run_phase(target, args, attacks, bodies)).summary()
    print(f"attack: {json.dumps(phases['attack'])}", flush=True)
    rss_end = _rss_by_process(args.server_pid)
    passed, problems, ratio = verdict(phases, args.max_ttft_ratio)
    doc = {"suite": "soak", "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
           "environment": serve.environment(None, None),
           "config": {"base_url": base_url, "model": model, "duration_s": args.duration, "clients": args.clients,
                      "attackers": args.attackers, "attacks": attacks, "input_len": args.input_len,
                      "max_tokens": args.max_tokens, "max_ttft_ratio": args.max_ttft_ratio},
           "phases": phases, "ttft_p99_ratio": ratio,
           "rss_mb": {"idle": _rss_mb(rss_idle), "start": _rss_mb(rss_start), "end": _rss_mb(rss_end)},
           "rss_mb_by_process": {"idle": rss_idle, "start": rss_start, "end": rss_end},
           "passed": passed, "problems": problems}
    path = args.result_file or args.result_dir / f"soak-{doc['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    if plot(doc, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    print("PASS" if passed else "FAIL: " + "; ".join(problems))
    return 0 if passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kestrel bench soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
