"""Backpressure: the count of in-flight events of one pipeline, with hysteresis.

In flight means consumed but not yet acknowledged. The state turns paused at `high`
and back at `low`; the consumer side acts on it (the Faust agent stops taking events,
the bare poll thread pauses its partitions), so memory stays bounded whatever the
load, and the event loop never blocks on it.
"""

from __future__ import annotations

import asyncio

from streams import metrics


class InFlight:
    def __init__(self, pipeline: str, high: int, low: int) -> None:
        self.high = high
        self.low = low
        self.count = 0
        self.paused = False
        self._drained = asyncio.Condition()
        self._count_metric = metrics.IN_FLIGHT.labels(pipeline)
        self._paused_metric = metrics.PAUSED.labels(pipeline)
        self._pauses_metric = metrics.PAUSES.labels(pipeline)

    def add(self, count: int) -> None:
        self.count += count
        self._count_metric.set(self.count)
        if not self.paused and self.count >= self.high:
            self.paused = True
            self._pauses_metric.inc()
            self._paused_metric.set(1)

    async def done(self, count: int) -> None:
        self.count -= count
        self._count_metric.set(self.count)
        if self.paused and self.count <= self.low:
            self.paused = False
            self._paused_metric.set(0)
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
