"""Runs one pipeline's batches through overlapping stages, bounded and in order.

    consumer ──submit──► MicroBatcher ──► decode, admit ──► features ──► re-check, infer
                          ──► publish ──► ack
                          (in-flight bound: pause fetching at `high`, resume at `low`)

Admission happens as a batch is released and again before its inference, with the
`CompletionModel`: the runner reserves each admitted batch's model work until its run
ends, and measures model runs and the rest of each batch's path.

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
from streams.admission import Estimates, Route
from streams.batching import BatchPolicy, MicroBatcher
from streams.completion import CompletionModel
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
    reservation_s: float = 0.0
    """Its full-model work as counted ahead of later batches (CompletionModel)."""
    outside_model_s: float = 0.0
    """Seconds spent so far outside the model runs (decode, features)."""


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
        self._completion = CompletionModel(sessions=concurrent_inference)
        self._seed_run_times()
        self._metrics = pipeline.metrics

    def _seed_run_times(self) -> None:
        # The models' warm-up runs: better first estimates than none, until measured.
        fallback = self.pipeline.fallback_model
        self._completion.seed(
            self.pipeline.model.warmup_seconds,
            max(fallback.warmup_seconds.values()) if fallback is not None else 0.0,
        )

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
            # Decode and admit at once, before any feature or model work is spent.
            prepared = await self._retrying(batch, "decode", self._decode, batch.records)
            now = time.monotonic()
            estimates = self._estimates("admission", now, len(batch.records))
            self.pipeline.route(prepared.admitted, estimates)
            batch.reservation_s = self._completion.reserve(prepared.count(Route.FULL), now)
            features = asyncio.create_task(
                self._retrying(batch, "features", self.pipeline.read_features, prepared)
            )
            await self._to_infer.put((batch, prepared, features, time.monotonic()))

    async def _decode(self, records: list[InputRecord]) -> Prepared:
        # A coroutine for `_retrying`: an unreachable registry is worth retrying.
        return self.pipeline.decode(records)

    async def _infer(self) -> None:
        while True:
            batch, prepared, features, queued = await self._to_infer.get()
            await features
            started = time.monotonic()
            self._inference_wait.observe(started - queued)
            batch.outside_model_s = (
                prepared.timings["decode_us"] + prepared.timings["features_us"]
            ) / 1e6
            # Again, now that its features are read: the work ahead may have grown.
            full = [item for item in prepared.admitted if item.route is Route.FULL]
            estimates = self._estimates(
                "inference", started, len(batch.records), batch.reservation_s
            )
            self.pipeline.route(full, estimates)
            inference = asyncio.create_task(self._run_models(batch, prepared))
            await self._to_publish.put((batch, prepared, inference, time.monotonic()))

    async def _run_models(self, batch: _Batch, prepared: Prepared) -> None:
        try:
            await self._retrying(batch, "inference", self.pipeline.infer, prepared)
        finally:
            self._completion.release(batch.reservation_s)
        now = time.monotonic()
        runs = prepared.run_seconds
        if Route.FULL in runs:
            self._completion.full_runs.observe(prepared.count(Route.FULL), runs[Route.FULL], now)
        if Route.FALLBACK in runs:
            self._completion.fallback_runs.observe(runs[Route.FALLBACK], now)

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
            publish_s = done - started
            slowest_s = max(batch.outside_model_s, *prepared.run_seconds.values(), publish_s)
            self.policy.stage_times.observe(size, slowest_s)
            self.policy.completion_times.observe(size, done - batch.released)
            self._completion.rest.observe(size, batch.outside_model_s + publish_s, done)
            await self.in_flight.done(size)

    def _estimates(
        self, check: str, now: float, batch_size: int, own_reservation_s: float = 0.0
    ) -> Estimates:
        estimates = self._completion.estimates(now, batch_size, own_reservation_s)
        self._metrics.estimate("full", check).set(estimates.full_s(1))
        self._metrics.estimate("fallback", check).set(estimates.fallback_s)
        return estimates

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
