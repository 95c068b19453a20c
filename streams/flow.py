"""Backpressure: a bound on in-flight events, with pause and resume of fetching.

In flight means consumed but not yet acknowledged. At `high` the consumer's
partitions are paused; they resume when the count drains to `low`, so memory stays
bounded whatever the load, and the event loop never blocks on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from streams import metrics


class InFlight:
    def __init__(
        self,
        pipeline: str,
        high: int,
        low: int,
        pause: Callable[[], None],
        resume: Callable[[], None],
    ) -> None:
        self._pipeline = pipeline
        self.high = high
        self.low = low
        self._pause = pause
        self._resume = resume
        self.count = 0
        self.paused = False
        self._drained = asyncio.Condition()

    def add(self, count: int) -> None:
        self.count += count
        metrics.IN_FLIGHT.labels(self._pipeline).set(self.count)
        if not self.paused and self.count >= self.high:
            self.paused = True
            metrics.PAUSES.labels(self._pipeline).inc()
            metrics.PAUSED.labels(self._pipeline).set(1)
            self._pause()

    async def done(self, count: int) -> None:
        self.count -= count
        metrics.IN_FLIGHT.labels(self._pipeline).set(self.count)
        if self.paused and self.count <= self.low:
            self.paused = False
            metrics.PAUSED.labels(self._pipeline).set(0)
            self._resume()
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
