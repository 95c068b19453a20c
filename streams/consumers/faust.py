"""The Faust runtime: one agent per pipeline, fed a fetch at a time.

Faust consumes (group membership, partitions, fetching, committing acked offsets);
each agent takes its input topic's records a fetch at a time (`faust_feed.py`: Faust's
own per-record delivery cost more than the whole pipeline) and hands them to its
pipeline's `PipelineRunner`, which acknowledges each record through Faust's consumer
once its outcome is written; Faust commits only acknowledged offsets. Faust's own
`concurrency` must stay 1 per agent: more can commit past unprocessed offsets.

On a rebalance Faust waits until every record the agents took is acknowledged, but it
commits only on its timer, and then seeks even the partitions this worker keeps back to
their committed offsets: whatever was answered since the last commit was answered
again; and chunks fetched but not yet taken by an agent were answered after that
commit. So the worker lets its agents finish every fetched chunk, then commits, before
the partitions move (`_commit_before_rebalance`). With exactly-once delivery the
offsets go in the batches' transactions instead (`faust_transactions.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import faust
from faust.types import TP, Message

from streams.backpressure import InFlight
from streams.config import HeadraceConfig
from streams.consumers.faust_feed import FeedApp
from streams.consumers.faust_transactions import (
    LostPartitions,
    StableOffsets,
    UnstableOffsets,
    aiokafka_group_metadata,
)
from streams.drain import DrainDeadline
from streams.freeze import FreezeWatch
from streams.health import Health
from streams.lag import REFRESH_S, InputProgress, refresh_faust
from streams.logs import faust_json_logging
from streams.records import InputRecord
from streams.replay import AnsweredBefore
from streams.runner import MakeRunner, PipelineRunner
from streams.transact import TransactionalPublisher, UnfinishedRevoke


def serve(
    config: HeadraceConfig,
    make_runner: MakeRunner,
    health: Health,
    log_level: str,
    answered_before: AnsweredBefore | None = None,
    freeze: FreezeWatch | None = None,
    transactions: Transactions | None = None,
) -> None:
    """Run a Faust worker until SIGTERM or SIGINT (Faust handles both, stopping within
    `drain_timeout_s`). With `transactions` (exactly-once delivery), each batch's
    offsets are committed in its transaction (`faust_transactions`)."""
    # Faust insists on a data directory, which its in-memory tables leave empty but for a
    # version stamp: one per worker start, removed when it stops (kept only by a kill -9).
    with tempfile.TemporaryDirectory(prefix="headrace-faust-", ignore_cleanup_errors=True) as data:
        _serve(config, make_runner, health, log_level, answered_before, freeze, transactions,
               data)  # fmt: skip


@dataclass
class Transactions:
    """What exactly-once delivery needs on the Faust runtime: the transactional
    publisher (which reads the consumer's group metadata) and what ends the worker
    when a rebalance takes partitions whose records are not committed yet."""

    publisher: TransactionalPublisher
    on_fatal: Callable[[BaseException, list[InputRecord]], Any]


def _serve(
    config: HeadraceConfig,
    make_runner: MakeRunner,
    health: Health,
    log_level: str,
    answered_before: AnsweredBefore | None,
    freeze: FreezeWatch | None,
    transactions: Transactions | None,
    datadir: str,
) -> None:
    app = FeedApp(
        config.app_id,
        fetch=config.broker.fetching("faust"),
        fetch_max_bytes=config.broker.fetch_max_bytes,
        # aiokafka's max_partition_fetch_bytes. Soft, like fetch_max_bytes: a larger
        # record still comes, whole, as a fetch of its own.
        consumer_max_fetch_size=config.broker.max_partition_fetch_bytes,
        broker=f"kafka://{config.broker.bootstrap_servers}",
        store="memory://",
        datadir=datadir,
        web_enabled=False,
        topic_disable_leader=True,
        topic_allow_declare=False,
        consumer_auto_offset_reset="earliest",
        commit_wait_s=config.broker.commit_interval_ms / 1000,
        # Faust's own timers run at multiples of it (0 would make them spin); the
        # commits themselves follow `commit_wait_s` (`BulkConsumer._commit_handler`).
        broker_commit_interval=(config.broker.commit_interval_ms or 100) / 1000,
        broker_session_timeout=config.broker.session_timeout_ms / 1000,
        broker_heartbeat_interval=config.broker.heartbeat_interval_ms / 1000,
        consumer_group_instance_id=config.broker.instance_id,
        consumer_metadata_max_age_ms=config.broker.metadata_refresh_ms,
        # A fetch is handed to an agent whole: its size bounds how far a chunk can go
        # past the in-flight bound (as the confluent runtime's chunk does).
        broker_max_poll_records=max(p.max_batch_size for p in config.pipelines),
    )
    if transactions is None:
        app.on_partitions_revoked.connect(_commit_before_rebalance)
    else:
        _commit_in_transactions(app, config, transactions)

    progress = {spec.input_topic: InputProgress(spec.name) for spec in config.pipelines}
    checks = _AssignmentChecks(answered_before) if answered_before is not None else None
    for spec in config.pipelines:
        runner = _add_agent(app, spec.name, spec.input_topic, spec.max_in_flight,
                            spec.resume_at, make_runner, progress[spec.input_topic], health,
                            checks)  # fmt: skip
        if checks is not None:
            checks.runners[spec.input_topic] = runner

    ever_joined = False

    @app.on_partitions_revoked.connect
    async def left(_app, revoked, **_kwargs) -> None:
        health.revoked()
        # A revoke before the first assignment is the first join's own (no member id yet).
        if ever_joined and app.dropped_by_group():
            health.lost_group()

    @app.on_partitions_assigned.connect
    async def joined(_app, assigned, **_kwargs) -> None:
        nonlocal ever_joined
        ever_joined = True
        health.joined(True)
        if checks is not None and assigned:
            checks.start(assigned)

    if freeze is not None:
        # aiokafka heartbeats from this loop (`faust_feed`): blocked past the session, the
        # worker loses its partitions as a frozen one does.
        app.task(freeze.watch_loop)

    @app.timer(REFRESH_S)
    async def consumer_lag() -> None:
        await refresh_faust(app.consumer, progress)

    logging_config = faust_json_logging() if config.log_format == "json" else None
    worker = _Worker(app, loglevel=log_level, quiet=True, logging_config=logging_config)
    # No start-up spinner: to turn on every log record it sets the root logger to DEBUG,
    # so every debug call of aiokafka and mode built a record (~10% of the worker's CPU
    # under load); and its terminal codes would land inside JSON lines.
    worker.spinner = None
    worker.health, worker.drain_timeout_s = health, config.drain_timeout_s
    try:
        worker.execute_from_commandline()
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    if worker.deadline is not None:
        worker.deadline.met()


class _Worker(faust.Worker):
    """Faust's worker, whose stop on a signal is bounded by `drain_timeout_s`."""

    health: Health
    drain_timeout_s: float
    deadline: DrainDeadline | None = None

    def _schedule_shutdown(self, signal) -> None:
        if not self._signal_stop_time:
            self.health.draining()
            self.deadline = DrainDeadline(self.drain_timeout_s)  # ends a late stop
        super()._schedule_shutdown(signal)


async def _commit_before_rebalance(app: FeedApp, revoked, **_kwargs) -> None:
    # Sent after Faust paused fetching and waited for the records the agents took; the
    # chunks still queued for them are answered too, then all of it committed.
    with contextlib.suppress(TimeoutError):
        await app.settle(timeout_s=app.conf.broker_session_timeout / 2)
    await app.consumer.commit()


def _commit_in_transactions(
    app: FeedApp, config: HeadraceConfig, transactions: Transactions
) -> None:
    """Exactly-once: offsets go in the batches' transactions, sent with aiokafka's group
    metadata; Faust seeks to stable offsets and commits nothing itself; a rebalance
    waits for what was taken to be committed, or ends the worker; partitions the group
    took away with a lapsed session are given up (`LostPartitions`)."""
    app.stable_offsets = StableOffsets(config.app_id, config.broker)
    app.lost = lost = LostPartitions(transactions.publisher, transactions.on_fatal)

    def unstable(exc: UnstableOffsets) -> NoReturn:
        transactions.on_fatal(exc, [])

    app.on_unstable = unstable

    async def read_group_metadata() -> bytes:
        return aiokafka_group_metadata(app.consumer._thread._ensure_consumer())

    transactions.publisher.attach(read_group_metadata)

    def unfinished(messages: list[Message]) -> None:
        partitions = sorted({(m.topic, m.partition) for m in messages})
        transactions.on_fatal(UnfinishedRevoke(len(messages), partitions), [])

    app.on_unfinished = unfinished

    @app.on_partitions_revoked.connect
    async def finish_before_rebalance(_app, revoked, **_kwargs) -> None:
        # After Faust's wait for what the agents took (`BulkConsumer.wait_empty`): the
        # chunks still queued for them are answered and committed too, or the worker ends
        # (but for partitions given up: `BulkConsumer.on_partitions_revoked`).
        if set(revoked) <= lost.partitions:
            return  # nothing of theirs can commit before this worker joins again
        with contextlib.suppress(TimeoutError):
            await app.settle(timeout_s=app.conf.broker_session_timeout / 2)
        left = app.unfinished()
        if left:
            unfinished(left)


def _add_agent(
    app: FeedApp,
    name: str,
    input_topic: str,
    high: int,
    low: int,
    make_runner: MakeRunner,
    progress: InputProgress,
    health: Health,
    checks: _AssignmentChecks | None,
) -> PipelineRunner:
    topic = app.topic(
        input_topic, key_type=bytes, value_type=bytes, key_serializer="raw",
        value_serializer="raw",
    )  # fmt: skip
    # At the bound the agent stops taking chunks; its feed fills, Faust's fetch loop
    # waits on it and fetching stops (bounded by aiokafka's own buffer).
    in_flight = InFlight(name, high=high, low=low)

    def ack(messages: list) -> None:
        # The outcomes are written: Faust may now commit these offsets.
        consumer = app.consumer
        consumer_ack = consumer.ack
        for message in messages:
            consumer_ack(message)
        consumer.acked()
        progress.answered({(m.topic, m.partition): m.offset for m in messages})

    def hold(topic: str, partition: int, paused: bool) -> None:
        app.consumer.hold(TP(topic, partition), paused)

    runner = make_runner(name, in_flight, ack, hold)
    app.holders.append(runner.give_up_held)
    app.add_feed(topic)

    async def consume(_stream) -> None:
        # The agent's stream stays unused: records arrive a fetch at a time on the feed.
        await runner.start()
        health.serving(asyncio.get_running_loop(), name, lambda: runner.unanswered)
        try:
            while True:
                messages = await app.take(input_topic)
                records = [_input_record(message) for message in messages]
                if checks is not None and checks.pending:
                    await checks.wait(records)
                progress.read(records)
                runner.submit(records, messages)
                # At the bound: take nothing more until drained to the low-water mark.
                await in_flight.wait_resumed()
        except asyncio.CancelledError:
            # Shutting down: write and ack what was taken before Faust commits.
            await runner.drain()
            raise
        finally:
            await runner.stop()

    app.agent(topic, name=f"headrace.{name}", concurrency=1)(consume)
    return runner


class _AssignmentChecks:
    """Per newly assigned partition, the read-back of the inputs answered before
    (`streams/replay.py`), run on a thread; the partition's records wait for it, so that
    the runner knows what to skip before any of them is submitted (Faust may hand over
    a fetch of the new assignment while the check runs). Only a partition's latest check
    counts: one of an earlier assignment that ends later is ignored."""

    def __init__(self, answered_before: AnsweredBefore) -> None:
        self._answered_before = answered_before
        self.runners: dict[str, PipelineRunner] = {}
        self.pending: dict[tuple[str, int], asyncio.Task] = {}

    def start(self, assigned: set[TP]) -> None:
        partitions = [(tp.topic, tp.partition) for tp in assigned]
        check = asyncio.ensure_future(self._check(partitions))
        self.pending.update(dict.fromkeys(partitions, check))

    async def _check(self, partitions: list[tuple[str, int]]) -> None:
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(None, self._answered_before.scan, partitions)
        # A partition assigned again meanwhile (two rebalances in a row) has a newer check:
        # this one's findings, older, would replace its findings in the runner.
        this = asyncio.current_task()
        found = {where: replay for where, replay in found.items()
                 if self.pending.get(where) is this}  # fmt: skip
        for topic, runner in self.runners.items():
            mine = {where: offsets for where, offsets in found.items() if where[0] == topic}
            if mine:
                runner.answered_before(mine)

    async def wait(self, records: list[InputRecord]) -> None:
        checks = {self.pending.get((r.topic, r.partition)) for r in records} - {None}
        if checks:
            await asyncio.gather(*checks)
        self.pending = {where: check for where, check in self.pending.items() if not check.done()}


def _input_record(message) -> InputRecord:
    return InputRecord(
        topic=message.topic,
        partition=message.partition,
        offset=message.offset,
        # Faust reports the Kafka timestamp in (float) seconds.
        timestamp_ms=round(message.timestamp * 1000),
        key=message.key,
        value=message.value,
        headers=message.headers or (),
    )
