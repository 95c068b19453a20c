"""Runs one pipeline's batches through overlapping stages, bounded and in order.

    consumer ──submit──► decode (deadline, priority) ──► MicroBatcher ──► admit
      ──► features ──► re-check, infer ──► publish ──► ack
      (in-flight bound: pause fetching at `high`, resume at `low`)

Each chunk a consumer submits is decoded first, so every event enters the batcher with
its deadline (computed once, from its event time). A record whose schema id is not
resolved yet waits, with the rest of its partition, while the decode stage looks the
id up on a thread, for as long as the registry takes (`streams/holds.py`): other
partitions go on, and a stalled partition is paused at its consumer. Lookup time is
never measured as decode time. Admission happens as a batch is released and again
before its inference, with the `CompletionModel`, which the batcher asks too: the
runner reserves each admitted batch's model work until its run ends, and measures
model runs, each batch's slowest stage and the rest of its path.

While batch k is in the model, batch k+1 reads its features and batch k-1 is being
published. Batches leave every stage in the order they entered, so outputs keep the
order of their inputs per key, and acknowledgements happen in offset order per
partition, each only after its outcome is acknowledged by Kafka.

A stage error that retries cannot fix ends the process (`on_fatal`): nothing that was
not written is ever acknowledged, and a restarted worker answers it again. A registry
outage is not one: its records wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

from features.errors import FeatureStoreError
from models.errors import ModelError
from streams import eager, metrics
from streams.admit import NO_RESERVATION, CompletionModel, Estimates, Reservation, Route
from streams.backpressure import InFlight
from streams.batching import BatchPolicy, MicroBatcher
from streams.decode import EventDecoder
from streams.errors import PublishError
from streams.holds import LOOKUP_BACKOFF_S, Changes, PartitionHolds
from streams.logs import about
from streams.pipeline import Pipeline, Prepared
from streams.records import InputRecord, Item, partition_names
from streams.replay import Replay
from streams.shadow import ShadowScorer

log = logging.getLogger(__name__)

RETRY_DELAYS_S = (0.1, 0.3, 1.0, 3.0, 10.0)
TRANSIENT = (FeatureStoreError, ModelError, PublishError)

# Called once per written batch with the handles submitted with its records, in order.
AckBatch = Callable[[list[Any]], None]
# Called on the event loop to stop (True) or restart (False) fetching one partition
# (topic, partition) of the pipeline's input; never blocks.
PausePartition = Callable[[str, int, bool], None]


@dataclass
class _Batch:
    items: list[Item]
    reservation: Reservation = NO_RESERVATION
    """Its model run and publish as counted ahead of later batches (CompletionModel)."""
    outside_model_s: float = 0.0
    """Seconds spent so far outside the model runs (decode, features)."""

    @property
    def records(self) -> list[InputRecord]:
        return [item.record for item in self.items]


class PipelineRunner:
    """Owns the batcher and the stage tasks of one pipeline. `start()`, `submit()`,
    then `drain()` and `stop()` (both safe twice)."""

    def __init__(
        self,
        pipeline: Pipeline,
        decoder: EventDecoder,
        in_flight: InFlight,
        ack: AckBatch,
        on_fatal: Callable[[BaseException, Sequence[InputRecord]], NoReturn],
        concurrent_inference: int = 1,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        retry_delays_s: Sequence[float] = RETRY_DELAYS_S,
        pause: PausePartition | None = None,
        lookup_backoff_s: tuple[float, float] = LOOKUP_BACKOFF_S,
        publish_ahead: int = 0,
        shadow: ShadowScorer | None = None,
        unsure: Callable[[], bool] | None = None,
    ) -> None:
        self.pipeline = pipeline
        # Whether what is answered now may repeat another member's answers (the worker
        # was frozen past its group session: `streams/freeze.py`); such answers are marked.
        self._unsure = unsure
        self._shadow = shadow
        self._retry_delays_s = tuple(retry_delays_s)
        self.in_flight = in_flight
        self._decoder = decoder
        self._ack = ack
        self._on_fatal = on_fatal
        self._clock = clock
        spec = pipeline.config
        self._name = spec.name
        # The one service-time estimator: admission and the batcher both ask it.
        self._completion = CompletionModel(
            sessions=concurrent_inference, publishes_overlap=publish_ahead > 0
        )
        self._seed_run_times()
        self.policy = BatchPolicy(
            max_batch_size=spec.max_batch_size,
            max_wait_s=spec.max_wait_ms / 1000,
            adaptive=spec.batching == "adaptive",
            service=self._completion,
        )
        self._batcher: MicroBatcher[Item] = MicroBatcher(self.policy, clock, wall_clock)
        # Records waiting for their schema ids, per partition; a partition is paused
        # once it holds a batch's worth, so they stay well within the in-flight bound.
        self._holds = PartitionHolds(spec.max_batch_size, lookup_backoff_s, clock)
        # Per newly assigned partition, what its check found (`streams/replay.py`): offsets
        # already answered, acknowledged with their batches, not answered again; and
        # offsets it could not check, answered with a marker. Dropped once passed.
        self._replays: dict[tuple[str, int], Replay] = {}
        self._pause = pause
        self._submitted = asyncio.Event()
        self._bug: tuple[BaseException, Sequence[InputRecord]] | None = None
        self._draining = False
        self._to_infer: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._to_publish: asyncio.Queue = asyncio.Queue(maxsize=concurrent_inference)
        # With a publisher that commits batches in transactions (exactly-once), up to
        # `publish_ahead` later batches are handed over while one commits (the next
        # transaction takes them together); acknowledged in order as each commits.
        self._committing: asyncio.Queue | None = (
            asyncio.Queue(maxsize=publish_ahead) if publish_ahead else None
        )
        self._tasks: list[asyncio.Task] = []
        # Diagnostics gauges read at scrape time from what the last batch used, rather
        # than set on every batch for a value read every few seconds.
        self._last_target_size = spec.max_batch_size
        metrics.BATCH_TARGET.labels(self._name).set_function(lambda: self._last_target_size)
        self._last_estimates: dict[str, Estimates] = {}
        for check in ("admission", "inference"):
            for path in ("full", "fallback"):
                gauge = pipeline.metrics.estimate(path, check)
                gauge.set_function(partial(self._last_estimate, path, check))
        self._inference_wait = metrics.QUEUE_SECONDS.labels(self._name, "inference")
        self._publish_wait = metrics.QUEUE_SECONDS.labels(self._name, "publish")
        self._retries = metrics.RETRIES.labels(self._name)
        self._stalled = metrics.REGISTRY_STALLED.labels(self._name)
        self._lookup_failures = metrics.REGISTRY_LOOKUP_FAILURES.labels(self._name)
        self._metrics = pipeline.metrics

    def _seed_run_times(self) -> None:
        # The models' warm-up runs: better first estimates than none, until measured.
        fallback = self.pipeline.fallback
        self._completion.seed(
            self.pipeline.model.pool.warmup_seconds,
            max(fallback.pool.warmup_seconds.values()) if fallback is not None else 0.0,
        )

    def submit(self, records: Sequence[InputRecord], handles: Sequence[Any]) -> None:
        """Hand consumed records over, each with the handle the ack callback receives.
        Never blocks: the consumer bounds what it submits (the in-flight bound)."""
        if self._bug is not None:
            # The worker is ending for a bug met in an earlier chunk (the decode stage may
            # still await a registry lookup): what follows it is left unacknowledged, as
            # it is, never answered and acknowledged past the record the bug skipped.
            return
        submitted, held = len(records), None
        # Decoded at once, except what waits for a schema id: a hop through the decode
        # stage costs a loop iteration per chunk, which the Faust runtime makes milliseconds.
        if self._holds or self._decoder.needs_lookup(records):
            changes = self._holds.add(records, handles, self._decoder.lookup_ids(records))
            self._carry_out(changes)
            if self._holds.due():  # an id met for the first time: look it up now
                self._submitted.set()
            records = [record for record, _ in changes.ready]
            handles = [handle for _, handle in changes.ready]
            held = self._holds.held
        self.in_flight.add(submitted, held)
        if records:
            try:
                self._put(records, handles)
            except Exception as exc:  # a bug: never let it escape into the consumer (Faust
                self._bug = (exc, records)  # would ack the chunk): the decode stage meets
                self._submitted.set()  # it and stops the worker

    @property
    def name(self) -> str:
        """The pipeline's name."""
        return self._name

    @property
    def unanswered(self) -> int:
        """Records submitted and not acknowledged, except those waiting for the registry."""
        return self.in_flight.count - self.in_flight.held

    async def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._decode(), name=f"{self._name}-decode"),
                asyncio.create_task(self._release(), name=f"{self._name}-release"),
                asyncio.create_task(self._infer(), name=f"{self._name}-infer"),
                asyncio.create_task(self._publish(), name=f"{self._name}-publish"),
            ]
            if self._committing is not None:
                self._tasks.append(
                    asyncio.create_task(self._acknowledge_committed(), name=f"{self._name}-ack")
                )
            if self._shadow is not None:
                self._tasks.append(
                    asyncio.create_task(self._shadow.run(), name=f"{self._name}-shadow")
                )
            for task in self._tasks:
                task.add_done_callback(self._stage_ended)

    def _stage_ended(self, task: asyncio.Task) -> None:
        # A stage loop only ends by cancellation; anything else would stall the pipeline.
        if not task.cancelled() and task.exception() is not None:
            self._on_fatal(task.exception(), [])

    async def drain(self) -> list[Any]:
        """Release everything pending and wait until every submitted record is acked,
        except records waiting for their schema ids: those are given up, unacknowledged
        (a stop does not wait for the registry; the next worker reads them again), and
        their handles returned."""
        self._draining = True
        given_up = await self.give_up_held()
        self._batcher.flush()
        await self.in_flight.wait_below(1)
        return given_up

    async def give_up_held(self, partitions: Sequence[tuple[str, int]] | None = None) -> list[Any]:
        """Drop the records of `partitions` (None: all) waiting for their schema ids,
        unanswered and unacknowledged, and return their handles: for a stop or a
        rebalance, which must not wait for the registry (Kafka hands them out again).
        Their fetching is the caller's from here on."""
        changes = self._holds.give_up(partitions)
        self._stalled.dec(len(changes.flowing))
        if changes.ready:
            where = sorted({(record.topic, record.partition) for record, _ in changes.ready})
            log.warning(
                "pipeline %s: %d records of %s wait for their schema ids: left unanswered "
                "and unacknowledged, to be read again", self._name, len(changes.ready),
                partition_names(where),
                extra=about(self._name),
            )  # fmt: skip
            await self.in_flight.done(len(changes.ready), self._holds.held)
        return [handle for _, handle in changes.ready]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        while self._committing is not None and not self._committing.empty():
            tasks.append(self._committing.get_nowait()[2])  # batches still committing
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # Stages ---------------------------------------------------------------------

    async def _decode(self) -> None:
        """Looks up the schema ids held records wait for (on a thread), again after a
        backoff while the registry fails, and hands on the records each lookup frees."""
        holds = self._holds
        while True:
            if self._bug is not None:
                self._on_fatal(*self._bug)
            due = holds.due()
            if due:
                failed = await self._decoder.resolve(due)
                holds.looked_up(due, failed)
                self._lookup_failures.inc(len(failed))
                changes = holds.release()
                self.in_flight.set_held(holds.held)
                self._carry_out(changes)
                if changes.ready:
                    records = [record for record, _ in changes.ready]
                    try:
                        self._put(records, [handle for _, handle in changes.ready])
                    except Exception as exc:  # a bug: never ack what it may have skipped
                        self._on_fatal(exc, records)
                continue
            self._submitted.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._submitted.wait(), holds.next_due_s())

    def answered_before(self, found: dict[tuple[str, int], Replay]) -> None:
        """What a check of newly assigned partitions found (an entry per partition
        checked: it replaces what was known of it). Call on the event loop before their
        records are submitted."""
        for partition, replay in found.items():
            if replay.end > 0:
                self._replays[partition] = replay
            else:
                self._replays.pop(partition, None)

    def _put(self, records: Sequence[InputRecord], handles: Sequence[Any]) -> None:
        items = self._decoder.decode_known(records, handles)
        if self._replays:
            self._mark_replayed(items)
        self._mark_unsure(items)  # counted with the replays' marks, as they are prepared
        self._batcher.put(items, [item.deadline_s for item in items])
        if self._draining:
            self._batcher.flush()

    def _mark_replayed(self, items: list[Item]) -> None:
        replays = self._replays
        for item in items:
            record = item.record
            where = (record.topic, record.partition)
            replay = replays.get(where)
            if replay is None:
                continue
            offset = record.offset
            if offset in replay.answered:
                item.answered_before = True
            elif offset in replay.unchecked:
                item.redelivered = True
            if offset >= replay.end - 1:  # records come in offset order per partition
                del replays[where]

    def _carry_out(self, changes: Changes) -> None:
        """Pause, resume and report partitions as the holds decided (not `ready`)."""
        if self._pause is not None:
            for topic, partition in changes.pause:
                self._pause(topic, partition, True)
            for topic, partition in changes.resume:
                self._pause(topic, partition, False)
        for stall in changes.stalled:
            self._stalled.inc()
            log.warning(
                "pipeline %s: %s[%d] stalled: schema id %d cannot be resolved (%s); its "
                "records wait, other partitions go on, retrying with backoff",
                self._name, *stall.partition, stall.schema_id, stall.error,
                extra=_partition(self._name, stall.partition),
            )  # fmt: skip
        for flowing in changes.flowing:
            self._stalled.dec()
            log.warning(
                "pipeline %s: %s[%d] flows again after %.1f s stalled (%d records held)",
                self._name, *flowing.partition, flowing.stalled_s, flowing.held,
                extra=_partition(self._name, flowing.partition),
            )  # fmt: skip

    async def _release(self) -> None:
        while True:
            items = await self._batcher.next_batch()
            self._last_target_size = self._batcher.target_size()
            batch = _Batch(items)
            # Admit at once, before any feature or model work is spent.
            prepared = self.pipeline.prepare(items)
            now = self._clock()
            estimates = self._estimates("admission", now, len(items))
            with prepared.trace.stage("admit"):
                self.pipeline.route(prepared.admitted, estimates)
            full_events = prepared.count(Route.FULL)
            batch.reservation = self._completion.reserve(full_events, len(items), now)
            # Started at once: a read the cache answers is done before the hand-off.
            features = eager.start(
                self._retrying(batch.records, "features", self.pipeline.read_features, prepared)
            )
            await self._to_infer.put((batch, prepared, features, self._clock()))

    async def _infer(self) -> None:
        while True:
            batch, prepared, features, queued = await self._to_infer.get()
            await features
            started = self._clock()
            self._inference_wait.observe(started - queued)
            batch.outside_model_s = (
                prepared.timings["decode_us"] + prepared.timings["features_us"]
            ) / 1e6
            # Again, now that its features are read: the work ahead may have grown.
            full = [item for item in prepared.admitted if item.route is Route.FULL]
            estimates = self._estimates("inference", started, len(batch.items), batch.reservation)
            self.pipeline.route(full, estimates, features_read=True)
            inference = eager.start(self._run_models(batch, prepared))  # inline runs end here
            await self._to_publish.put((batch, prepared, inference, self._clock()))

    async def _run_models(self, batch: _Batch, prepared: Prepared) -> None:
        try:
            await self._retrying(batch.records, "inference", self.pipeline.infer, prepared)
        finally:
            self._completion.release_model(batch.reservation)
        now = self._clock()
        runs = prepared.run_seconds
        if Route.FULL in runs:
            self._completion.full_runs.observe(prepared.count(Route.FULL), runs[Route.FULL], now)
        if Route.FALLBACK in runs:
            self._completion.fallback_runs.observe(runs[Route.FALLBACK], now)

    async def _publish(self) -> None:
        while True:
            batch, prepared, inference, queued = await self._to_publish.get()
            await inference
            self._publish_wait.observe(self._clock() - queued)
            started = self._clock()
            # Records Kafka refuses are dead-lettered by the publisher; what it retries
            # here is Kafka being unwritable for now, and each retry sends only the
            # outcomes Kafka has not acknowledged (`prepared.outgoing` keeps them).
            written = self._retrying(batch.records, "publish", self._publish_once, batch, prepared)
            if self._committing is None:
                await written
                await self._acknowledge(batch, prepared, started)
            else:
                # Handed over now, in order; the next batch follows while it commits.
                committing = asyncio.ensure_future(written)
                await self._committing.put((batch, prepared, committing, started))

    async def _publish_once(self, batch: _Batch, prepared: Prepared) -> None:
        # Marked before every attempt: a batch decoded before a freeze, or one whose
        # attempt failed across it (frozen past `delivery.timeout.ms`), is sent marked.
        if marked := self._mark_unsure(batch.items):
            self._metrics.redelivered.inc(marked)
        await self.pipeline.publish(prepared)

    def _mark_unsure(self, items: Sequence[Item]) -> int:
        """While the worker may have been frozen past its session, mark what it answers
        `headrace.redelivered`; returns how many were not marked already."""
        if self._unsure is None or not self._unsure():
            return 0
        unmarked = [item for item in items if not item.redelivered]
        for item in unmarked:
            item.redelivered = True
        return len(unmarked)

    async def _acknowledge_committed(self) -> None:
        while True:
            batch, prepared, committing, started = await self._committing.get()
            await committing
            await self._acknowledge(batch, prepared, started)

    async def _acknowledge(self, batch: _Batch, prepared: Prepared, started: float) -> None:
        self._ack([item.handle for item in batch.items])
        if self._shadow is not None:  # after its answers are written, never before
            self._shadow.offer(prepared)
        self.pipeline.done(prepared)
        done = self._clock()
        size = len(batch.items)
        publish_s = done - started
        # A batch that commits while later ones are handed over does not hold them up.
        publish_bound_s = publish_s if self._committing is None else 0.0
        slowest_s = max(
            batch.outside_model_s, *prepared.run_seconds.values(), prepared.candidate_seconds,
            publish_bound_s,
        )  # fmt: skip
        self._completion.slowest_stages.observe(size, slowest_s, done)
        self._completion.rest.observe(size, batch.outside_model_s + publish_s, done)
        self._completion.published(batch.reservation, size, publish_s, done)
        await self.in_flight.done(size)

    def _estimates(
        self, check: str, now: float, batch_size: int, own: Reservation = NO_RESERVATION
    ) -> Estimates:
        estimates = self._last_estimates[check] = self._completion.estimates(now, batch_size, own)
        return estimates

    def _last_estimate(self, path: str, check: str) -> float:
        """The gauge's value: what the last batch's `check` estimated (0 before one)."""
        estimates = self._last_estimates.get(check)
        if estimates is None:
            return 0.0
        return estimates.full_s(1) if path == "full" else estimates.fallback_s

    async def _retrying(
        self, records: Sequence[InputRecord], stage: str, step: Callable[..., Awaitable], *args
    ):
        for attempt, delay_s in enumerate((*self._retry_delays_s, None), start=1):
            try:
                return await step(*args)
            except TRANSIENT as exc:
                if delay_s is None:
                    self._on_fatal(exc, records)
                log.warning(
                    "pipeline %s: %s of a batch failed (attempt %d: %s); retrying",
                    self._name, stage, attempt, exc, extra=about(self._name, records),
                )  # fmt: skip
                self._retries.inc()
                await asyncio.sleep(delay_s)
            except Exception as exc:  # a bug: never ack what it may have skipped
                self._on_fatal(exc, records)


def _partition(pipeline: str, partition: tuple[str, int]) -> dict[str, Any]:
    return {**about(pipeline), "topic": partition[0], "partition": partition[1]}


MakeRunner = Callable[[str, InFlight, AckBatch, PausePartition], PipelineRunner]
"""What a consumer runtime is given: builds the runner of the pipeline with this name."""
