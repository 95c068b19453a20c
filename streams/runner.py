"""Runs one pipeline's batches through overlapping stages, bounded and in order.

    consumer ──submit──► MicroBatcher ──► prepare ──► infer ──► publish ──► ack
                          (in-flight bound: pause fetching at `high`, resume at `low`)

Admission needs to know how long the rest of the path takes: the runner measures,
for batches with full-model work and for batches without ("light"), the seconds from
release to acknowledgement and from the start of inference to acknowledgement, and
hands their recent high quantiles to `prepare` and `infer`.

While batch k is in the model, batch k+1 reads its features and batch k-1 is being
published. Batches leave every stage in the order they entered, so outputs keep the
order of their inputs per key, and acknowledgements happen in offset order per
partition, each only after its outcome is acknowledged by Kafka.

A stage error that retries cannot fix ends the process (`on_fatal`): nothing that was
not written is ever acknowledged, and a restarted worker answers it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from features.errors import FeatureStoreError
from models.errors import ModelError
from schemas.errors import RegistryError
from streams import metrics
from streams.admission import Estimates, Route, SizedTimes
from streams.batching import BatchPolicy, MicroBatcher
from streams.errors import PublishError
from streams.flow import InFlight
from streams.pipeline import InputRecord, Pipeline, Prepared

log = logging.getLogger(__name__)

RETRY_DELAYS_S = (0.1, 0.3, 1.0, 3.0, 10.0)
TRANSIENT = (FeatureStoreError, ModelError, PublishError, RegistryError)

# Called once per written batch with the handles submitted with its records, in order.
AckBatch = Callable[[list[Any]], None]


@dataclass
class _Batch:
    records: list[InputRecord]
    handles: list[Any]
    released: float = field(default_factory=time.monotonic)
    inferring: float = 0.0


class _PathTimes:
    """Recent completion times of batches, by how many events the full model took,
    from release and from the start of inference."""

    def __init__(self) -> None:
        self.from_release = SizedTimes()
        self.from_inference = SizedTimes()

    def observe(self, batch: _Batch, full_events: int, done: float) -> None:
        self.from_release.observe(full_events, done - batch.released, done)
        self.from_inference.observe(full_events, done - batch.inferring, done)


class PipelineRunner:
    """Owns the batcher and the stage tasks of one pipeline. `start()`, `submit()`,
    then `drain()` and `stop()` (both safe twice)."""

    def __init__(
        self,
        pipeline: Pipeline,
        policy: BatchPolicy,
        in_flight: InFlight,
        ack: AckBatch,
        on_fatal: Callable[[BaseException, Sequence[InputRecord]], NoReturn],
        concurrent_inference: int = 1,
    ) -> None:
        self.pipeline = pipeline
        self.policy = policy
        self.in_flight = in_flight
        self._ack = ack
        self._on_fatal = on_fatal
        self._name = pipeline.config.name
        self._budget_s = pipeline.config.latency_budget_ms / 1000
        self._batcher: MicroBatcher[tuple[InputRecord, Any]] = MicroBatcher(policy)
        self._to_infer: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._to_publish: asyncio.Queue = asyncio.Queue(maxsize=concurrent_inference)
        self._tasks: list[asyncio.Task] = []
        self._target_size = metrics.BATCH_TARGET.labels(self._name)
        self._inference_wait = metrics.QUEUE_SECONDS.labels(self._name, "inference")
        self._publish_wait = metrics.QUEUE_SECONDS.labels(self._name, "publish")
        self._retries = metrics.RETRIES.labels(self._name)
        # Batches with full-model work, by its size; and those without ("light").
        self._full = _PathTimes()
        self._light = _PathTimes()
        self._metrics = pipeline.metrics

    def submit(self, records: Sequence[InputRecord], handles: Sequence[Any]) -> None:
        """Hand consumed records over, each with the handle the ack callback receives."""
        self.in_flight.add(len(records))
        deadlines = [r.timestamp_ms / 1000 + self._budget_s for r in records]
        self._batcher.put(list(zip(records, handles, strict=True)), deadlines)

    async def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._release(), name=f"{self._name}-release"),
                asyncio.create_task(self._infer(), name=f"{self._name}-infer"),
                asyncio.create_task(self._publish(), name=f"{self._name}-publish"),
            ]
            for task in self._tasks:
                task.add_done_callback(self._stage_ended)

    def _stage_ended(self, task: asyncio.Task) -> None:
        # A stage loop only ends by cancellation; anything else would stall the pipeline.
        if not task.cancelled() and task.exception() is not None:
            self._on_fatal(task.exception(), [])

    async def drain(self) -> None:
        """Release everything pending and wait until every submitted record is acked."""
        self._batcher.flush()
        await self.in_flight.wait_below(1)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # Stages ---------------------------------------------------------------------

    async def _release(self) -> None:
        while True:
            items = await self._batcher.next_batch()
            self._target_size.set(self._batcher.target_size())
            batch = _Batch([record for record, _ in items], [handle for _, handle in items])
            estimates = self._estimates("admission")
            prepare = asyncio.create_task(
                self._retrying(batch, "features", self.pipeline.prepare, batch.records, estimates)
            )
            await self._to_infer.put((batch, prepare, time.monotonic()))

    async def _infer(self) -> None:
        while True:
            batch, prepare, queued = await self._to_infer.get()
            prepared: Prepared = await prepare
            batch.inferring = time.monotonic()
            self._inference_wait.observe(batch.inferring - queued)
            inference = asyncio.create_task(
                self._retrying(
                    batch, "inference", self.pipeline.infer, prepared, self._estimates("inference")
                )
            )
            await self._to_publish.put((batch, prepared, inference, time.monotonic()))

    async def _publish(self) -> None:
        while True:
            batch, prepared, inference, queued = await self._to_publish.get()
            await inference
            self._publish_wait.observe(time.monotonic() - queued)
            started = time.monotonic()
            await self._retrying(batch, "publish", self.pipeline.publish, prepared)
            self._ack(batch.handles)
            done = time.monotonic()
            size = len(batch.records)
            timings = prepared.timings
            slowest_us = max(
                timings["decode_us"] + timings["features_us"],
                max(prepared.inference_us.values(), default=0),
                (done - started) * 1_000_000,
            )
            self.policy.stage_times.observe(size, slowest_us / 1_000_000)
            self.policy.completion_times.observe(size, done - batch.released)
            full_events = prepared.count(Route.FULL)
            (self._full if full_events else self._light).observe(batch, full_events, done)
            await self.in_flight.done(size)

    def _estimates(self, check: str) -> Estimates:
        """Conservative seconds to an answer for a batch entering `check` (admission or
        inference) now. Events sent to the fallback model are late ones, which mostly
        fill batches without full-model work, so the light path's time is theirs."""
        now = time.monotonic()
        window = "from_release" if check == "admission" else "from_inference"
        full_s = getattr(self._full, window).bounds(now)
        fallback_s = getattr(self._light, window).bounds(now)(0)
        self._metrics.estimate("full", check).set(full_s(1))
        self._metrics.estimate("fallback", check).set(fallback_s)
        return Estimates(full_s=full_s, fallback_s=fallback_s)

    async def _retrying(self, batch: _Batch, stage: str, step: Callable[..., Awaitable], *args):
        for attempt, delay_s in enumerate((*RETRY_DELAYS_S, None), start=1):
            try:
                return await step(*args)
            except TRANSIENT as exc:
                if delay_s is None:
                    self._on_fatal(exc, batch.records)
                log.warning(
                    "pipeline %s: %s of a batch failed (attempt %d: %s); retrying",
                    self._name, stage, attempt, exc,
                )  # fmt: skip
                self._retries.inc()
                await asyncio.sleep(delay_s)
            except Exception as exc:  # a bug: never ack what it may have skipped
                self._on_fatal(exc, batch.records)
