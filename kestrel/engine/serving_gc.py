"""The garbage collector of a long-running serving process (`kestrel serve` and its engine core process), set once
its engine is built.

A busy engine allocates a few container objects per request and step (outputs, deltas, bookkeeping), so the
collector runs all the time, and every so often a full collection walks the whole heap: torch, the tokenizer and
the server's modules, ~290k objects and ~110 ms on the development machine, during which the engine loop (and with
it the device) waits. Freezing what start-up left moves it to the permanent generation, which no collection
traverses; collecting the young generation every `YOUNG_THRESHOLD` allocations instead of CPython's 700 makes the
collections, and the full ones they trigger, rarer. Measured in docs/benchmarks.md ("Garbage collection in a
serving process"): a step's p99 at batch 256 from ~130 ms to ~7 ms. Offline `LLM` leaves its caller's collector
alone.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 5000


def tune_for_serving() -> int:
    """Collect the start-up garbage, freeze the rest and raise the young generation's threshold. Returns the number
    of objects frozen."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(YOUNG_THRESHOLD, young), middle, old)
    return gc.get_freeze_count()
