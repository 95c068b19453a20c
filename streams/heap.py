"""The worker's heap and Python's garbage collector: what keeps a full collection off
the tail latency.

Start-up leaves ~200,000 long-lived objects (Feast, protobuf, ONNX Runtime, pydantic,
Faust). CPython's full collection walks all of them: about 100 ms on these machines,
and the caches filling under traffic trigger one every few seconds, so an event in
flight then waits a tenth of its budget for nothing. Objects alive once the worker is
wired stay alive for its whole life, so they are moved out of the collector's sight
(`gc.freeze`); later collections walk only what traffic created. Pauses are measured
(`headrace_gc_pause_seconds`) so that a regression shows.
"""

from __future__ import annotations

import gc
import time

from streams import metrics

_started_at: dict[int, float] = {}


def settle_heap() -> None:
    """Call once the worker is wired and before it consumes: collects what start-up left
    behind, then freezes the survivors, and starts measuring every collection's pause."""
    gc.collect()
    gc.freeze()
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
