"""Run a module (a `kestrel bench` suite) with Triton's compile hooks recording every kernel this process compiles
or loads from Triton's cache, with when and how long: `python scripts/h200_count_compiles.py OUT.json MODULE
ARGS...`, e.g. `... OUT/compiles.json kestrel.bench.throughput --arch llama3-8b ...`. The bench's log marks its timed
window ("timed run"); a compile logged after that mark was paid inside the measurement."""

from __future__ import annotations

import json
import runpy
import sys
import time
from pathlib import Path

from triton import knobs

from kestrel.bench import common


def _differences(a: str, b: str) -> list[str]:
    """The comma-separated fields of two specialization keys that differ, as `field i: a | b`."""
    fa, fb = a.split(", "), b.split(", ")
    return [f"{i}: {x} | {y}" for i, (x, y) in enumerate(zip(fa, fb)) if x != y] + (
        [f"lengths {len(fa)} | {len(fb)}"] if len(fa) != len(fb) else [])


def main() -> None:
    out, module, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    events: list[dict] = []
    started: dict[str, float] = {}
    log = common.log
    marks: list[dict] = []

    def marked_log(msg: str) -> None:
        marks.append({"t": time.time(), "msg": msg[:120]})
        log(msg)

    def before(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        started[str(key)] = time.time()
        return False

    def after(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> None:
        now = time.time()
        begin = started.pop(str(key), now)
        events.append({"t": now, "s": round(now - begin, 3), "kernel": f"{fn.module}.{fn.name}",
                       "signature": str(key)})
        log(f"compiled {fn.name} in {now - begin:.2f} s")

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
    common.log = marked_log
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__")
    except SystemExit:
        pass
    finally:
        timed = next((m["t"] for m in marks if m["msg"].startswith("timed run")), None)
        inside = [e for e in events if timed is not None and e["t"] >= timed]
        for e in inside:  # what sets it apart from the same kernel's compiles before the timed run
            e["differs_from_earlier"] = [_differences(e["signature"], b["signature"]) for b in events
                                         if b["kernel"] == e["kernel"] and b["t"] < timed]
        out.write_text(json.dumps({"module": module, "args": args, "timed_run_started": timed, "marks": marks,
                                   "compiles": events, "compiles_in_timed_run": len(inside),
                                   "seconds_in_timed_run": round(sum(e["s"] for e in inside), 3)}, indent=1))
        print(f"{len(events)} compiles, {len(inside)} inside the timed run "
              f"({sum(e['s'] for e in inside):.1f} s)", flush=True)


if __name__ == "__main__":
    main()
