"""Backpressure: the count of in-flight events of one pipeline, with hysteresis.

In flight means consumed but not yet acknowledged. The state turns paused at `high`
and back at `low`; the consumer side acts on it (the Faust agent stops taking events,
the bare poll thread pauses its partitions), so memory stays bounded whatever the
load, and the event loop never blocks on it.

Records held for the schema registry (`streams/holds.py`) stay in flight but count
against neither mark: their partitions pause themselves, so a registry outage that
stalls many partitions does not pause the ones that flow.
"""

from __future__ import annotations

import asyncio

from streams import metrics


class InFlight:
    def __init__(self, pipeline: str, high: int, low: int) -> None:
        self.high = high
        self.low = low
        self.count = 0
        self.held = 0
        """Of `count`, records held for the registry (read by the bare poll thread)."""
        self.paused = False
        self._drained = asyncio.Condition()
        self._count_metric = metrics.IN_FLIGHT.labels(pipeline)
        self._paused_metric = metrics.PAUSED.labels(pipeline)
        self._pauses_metric = metrics.PAUSES.labels(pipeline)

    def add(self, count: int, held: int | None = None) -> None:
        """`count` more in flight; `held`: how many of all in flight are held now."""
        self.count += count
        self._count_metric.set(self.count)
        self.set_held(self.held if held is None else held)

    def set_held(self, held: int) -> None:
        """How many of the records in flight are held for the registry now. Only a
        release from a hold calls this alone; that can pause, never resume."""
        self.held = held
        bounded = self.count - held
        if not self.paused and bounded >= self.high:
            self.paused = True
            self._pauses_metric.inc()
            self._paused_metric.set(1)
        elif self.paused and bounded <= self.low:
            self.paused = False
            self._paused_metric.set(0)

    async def done(self, count: int, held: int | None = None) -> None:
        """`count` fewer in flight (acknowledged, or given up); `held` as for `add`."""
        self.count -= count
        self._count_metric.set(self.count)
        self.set_held(self.held if held is None else held)
        async with self._drained:
            self._drained.notify_all()

    async def wait_below(self, count: int) -> None:
        """Wait until fewer than `count` events are in flight."""
        async with self._drained:
            await self._drained.wait_for(lambda: self.count < count)

    async def wait_resumed(self) -> None:
        """Wait while fetching is paused (until in-flight events drained to `low`)."""
        async with self._drained:
            await self._drained.wait_for(lambda: not self.paused)
