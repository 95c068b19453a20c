"""The worker's heap and Python's garbage collector: what keeps a full collection off
the tail latency.

Start-up leaves ~200,000 long-lived objects (Feast, protobuf, ONNX Runtime, pydantic,
Faust). CPython's full collection walks all of them: about 100 ms on these machines,
and the caches filling under traffic trigger one every few seconds, so an event in
flight then waits a tenth of its budget for nothing. Objects alive once the worker is
wired stay alive for its whole life, so they are moved out of the collector's sight
(`gc.freeze`); later collections walk only what traffic created. Pauses are measured
(`headrace_gc_pause_seconds`) so that a regression shows.

What traffic creates is mostly freed by reference counting as each batch is answered;
the collector's thresholds count container objects allocated and not yet freed, and a
loaded worker holds thousands of them in flight at any moment. With CPython's defaults
(700, 10, 10), at 8,000 events/s (Faust) and 12,800/s (bare) on 2 cores, that set off
25-50 young collections a second and a full one every 2-5 s, of 5-30 ms (8-12 ms on
average): 2-3% of the worker's CPU, and the full ones a loop stall each. From 5,000 a
young collection runs about ten times a minute (2.5-7 ms each), and a full one only
after 100 middle ones: none at all in the same runs, and the collector's time fell from
0.8-2.1 s to 0.04-0.14 s per run (6 to 12 steps of 7 s, both runtimes, twice each).
"""

from __future__ import annotations

import gc
import time

from streams import metrics

# (young, middle, full) thresholds: see above.
GC_THRESHOLDS = (5_000, 10, 100)

_started_at: dict[int, float] = {}


def settle_heap() -> None:
    """Call once the worker is wired and before it consumes: collects what start-up left
    behind, freezes the survivors, sets the thresholds for traffic, and starts measuring
    every collection's pause."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    if _observe_pause not in gc.callbacks:
        gc.callbacks.append(_observe_pause)


def _observe_pause(phase: str, info: dict) -> None:
    generation = info["generation"]
    if phase == "start":
        _started_at[generation] = time.perf_counter()
        return
    started = _started_at.pop(generation, None)
    if started is not None:
        metrics.GC_PAUSE_SECONDS.labels(str(generation)).observe(time.perf_counter() - started)
