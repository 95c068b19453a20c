"""Faust's fetched records handed to the pipelines' agents a fetch at a time.

faust-streaming delivers every record on its own: its fetch loop
(`Consumer._drain_messages`) awaits each delivery with `Service.wait_first`, which
wraps four asyncio tasks around every record, and its conductor then builds an
`Event` and queues it for the agent's stream. That costs 60-85 µs of CPU per event on
these machines before any pipeline work (DESIGN.md), and the pipeline batches anyway.

`BulkConsumer` keeps Faust's consumer (group membership, assignment, aiokafka fetching,
flow control on rebalance, committing what was acked) and replaces only that loop:
each fetch is taken whole (Faust's `getmany` yields it a record at a time), split by
topic, and the records of a pipeline's input topic go to its agent as one chunk
through a small bounded queue (`FeedApp.take`). The
agent acks each record through `Consumer.ack` after its outcome is written, which is
what Faust commits from; a record is tracked as unacked from the moment the agent takes
it, so Faust's wait for unacked records on rebalance and stop covers it. Topics without a
feed (none in a headrace worker) still go through Faust's own path.

A chunk belongs to the assignment it was fetched in. Each assignment gives every
partition a fresh position, which Faust seeks to the committed offsets: a chunk still
queued then (or on its way to the queue, its fetch loop waiting for room) is dropped
when taken, and its records are fetched again. Answered after the seek instead, its
records were answered twice: once from the chunk, once as fetched again (`Chunk`).

Backpressure: an agent at its in-flight bound stops taking chunks, its queue fills,
the fetch loop waits on it, and aiokafka stops fetching once its own buffer is full.
A runner can pause one partition whose records wait for the schema registry
(`BulkConsumer.hold`); what it holds is given up before Faust waits for acks (a stop
or a rebalance), so neither waits for the registry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn

import faust
from aiokafka.protocol.group import JoinGroupRequest
from confluent_kafka import KafkaException
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP, Message
from faust.utils import terminal
from mode import Service
from mode.utils.futures import maybe_async

from streams.consumers import aiokafka_closed
from streams.consumers.faust_transactions import (
    LostPartitions,
    StableOffsets,
    UnstableOffsets,
    released,
)

# Chunks waiting for an agent: one being fetched while one is handed over.
FEED_CHUNKS = 2
# Fetches answered on the first byte (idle and light load; see `_LoopConsumer`).
IDLE_FETCH = (500, 1)
# Records one busy wait (the broker config's `fetch_max_wait_ms`) would gather at the
# measured rate, from which fetches wait for them, and below which they stop waiting:
# with the defaults (5 ms), from 3,200 events/s and below 2,000/s.
BUSY_RECORDS_PER_WAIT = 16.0
IDLE_RECORDS_PER_WAIT = 10.0
# How long the rate is counted before the fetch mode is chosen again.
PACE_WINDOW_S = 0.1


class Chunk(list):
    """One fetch's records of one topic, with the consumer's seek count when fetched."""

    def __init__(self, messages: list[Message], seeks: int) -> None:
        super().__init__(messages)
        self.seeks = seeks


class _TerminalWithoutTables:
    """Faust's terminal helpers, except `logtable`: Faust's consumer renders a table of
    the offsets on every commit (ten a second here) for a log line it writes only in its
    developers' mode (`DEVLOG`), ~1% of the worker's CPU. The commit is its only use."""

    def __getattr__(self, name: str) -> Any:
        return getattr(terminal, name)

    @staticmethod
    def logtable(*_args: Any, **_kwargs: Any) -> str:
        return ""


faust_consumer.terminal = _TerminalWithoutTables()
# aiokafka runs on the worker's loop, uvloop by default (see `aiokafka_closed`).
aiokafka_closed.install()


class _LoopConsumer(faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's aiokafka consumer, run on the worker's own event loop, with fetch waits
    chosen by load.

    Faust runs aiokafka in a thread with an event loop of its own and hands every call
    (each fetch, each commit) across with two cross-thread wake-ups, and the keepalive
    timers of both loops tick besides. On two cores that was 0.15 cores at 100 events/s,
    most of it waking threads. aiokafka is asyncio code: here it runs on the loop that
    consumes its fetches, and a call is a plain await. The class stays Faust's service
    (its rebalance listener, commit and seek code are unchanged); only how it starts,
    stops and is called differs.

    Faust hard-codes `fetch_max_wait_ms=1500` with aiokafka's `fetch_min_bytes=1`: the
    broker answers each fetch as soon as one record is there, and aiokafka's fetch round
    trip is Python. Near the worker's limit, waiting a few milliseconds for a few
    kilobytes (the broker config's `fetch_max_wait_ms` and `fetch_min_bytes`) puts more
    records in each fetch, and the CPU it saves is throughput (11,200 against 8,000
    events/s in one pair of runs). Below that, the wait is latency: at 1,600/s it put
    the median 6.9 ms over a plain Kafka round trip, against 2.2 ms answered on the first
    byte, for 222 against 354 µs of CPU per event. Idle, a short wait would fetch 200
    times a second for nothing (0.1 core). So fetches wait only while the input's rate
    fills a wait with sixteen records or more (`FetchPace`); otherwise they are answered
    on the first byte with a long wait, which costs nothing at rest, as the bare
    runtime's are by default.
    """

    busy = False
    gave_up_commits = False

    def __init__(self, consumer: Any, *, loop: asyncio.AbstractEventLoop, **kwargs: Any):
        super().__init__(consumer, loop=loop, thread_loop=loop, **kwargs)
        self._pace = FetchPace(busy_wait_s=self.app.fetch[0] / 1000)

    async def start(self) -> None:  # a plain service's start: no thread
        self._thread_started.set()
        await Service.start(self)

    async def stop(self) -> None:
        if self._started.is_set() and not self._stopped.is_set():
            self._stopped.set()
            await self.on_stop()
            # What Faust's thread runs as it ends: aiokafka's stop, children, futures.
            await self._shutdown_thread()
            await self.on_shutdown()

    async def call_thread(self, fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await maybe_async(fun(*args, **kwargs))

    async def _commit(self, offsets: Any) -> bool:
        """Faust's commit, given up once the consumer is closed. Faust closes it when a
        rebalance begins while the worker stops (the group has moved on: say, the loop
        was blocked past the session), and aiokafka would then retry the stop's commit
        for ever, for a coordinator it no longer looks up. What is not committed is
        answered again by the partitions' next owner."""
        coordinator = getattr(self._ensure_consumer(), "_coordinator", None)
        if coordinator is None:
            return await super()._commit(offsets)
        closing: asyncio.Future = coordinator._closing
        commit = asyncio.ensure_future(super()._commit(offsets))
        try:
            await asyncio.wait({commit, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not commit.done():
                commit.cancel()
                await asyncio.wait({commit})
        if commit.cancelled():
            if not self.gave_up_commits:  # Faust's commit timer keeps asking until it stops
                self.log.warning("consumer closed by a rebalance while stopping: not committing")
                self.gave_up_commits = True
            return False
        return commit.result()

    held: frozenset[Any] = frozenset()
    """With exactly-once: the partitions (aiokafka's TopicPartition) the last seek left
    out, their committed offsets held by an open transaction (`BulkConsumer` fetches
    them once it ends)."""

    async def seek_to_committed(self) -> Mapping[TP, int | None]:
        """Faust's seek after an assignment (and whenever it must go back): with
        exactly-once to the offsets no open transaction holds any more
        (`faust_transactions`), read on a thread; otherwise aiokafka's. Partitions a
        transaction holds now are left out (`held`, their offsets None), so that one
        previous owner's open transaction does not hold up the others."""
        reader = self.app.stable_offsets
        if reader is None:
            return await super().seek_to_committed()
        consumer = self._ensure_consumer()
        assigned = {(tp.topic, tp.partition): tp for tp in consumer.assignment()}
        try:
            held = await asyncio.to_thread(reader.held, assigned)
        except (KafkaException, TimeoutError):  # cannot tell: wait for them all, as the read does
            held = set()
        self.held = frozenset(assigned[where] for where in held)
        try:
            offsets = await asyncio.to_thread(reader, [w for w in assigned if w not in held])
        except UnstableOffsets as exc:  # Faust's recovery would crash on it, exit unknown
            self.app.on_unstable(exc)
        for where, offset in offsets.items():
            if offset >= 0:  # none committed: where auto_offset_reset put it
                consumer.seek(assigned[where], offset)
        return {tp: offsets[where] if offsets.get(where, -1) >= 0 else None
                for where, tp in assigned.items()}  # fmt: skip

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # Read by aiokafka when the consumer starts (its fetcher's first settings).
        consumer._fetch_max_wait_ms, consumer._fetch_min_bytes = IDLE_FETCH
        consumer._fetch_max_bytes = self.app.fetch_max_bytes  # Faust has no setting for it
        # As librdkafka reads by default (the bare runtime): records of an aborted or still
        # open transaction upstream are not inputs yet. aiokafka's default reads them.
        consumer._isolation_level = "read_committed"
        return consumer

    def fetched(self, count: int) -> None:
        """Called after each fetch with its record count: choose the next fetch's wait."""
        busy = self._pace.busy(count)
        fetcher = getattr(self._consumer, "_fetcher", None)
        if busy != self.busy and fetcher is not None:
            # Plain attributes, read by aiokafka's fetch loop for every request it builds.
            wait_ms, min_bytes = self.app.fetch if busy else IDLE_FETCH
            fetcher._fetch_max_wait_ms, fetcher._fetch_min_bytes = wait_ms, min_bytes
            self.busy = busy


class FetchPace:
    """Whether fetches should wait to gather records, from the rate they bring.

    A busy fetch waits `busy_wait_s` for more records. That halves the CPU per event at
    400-1,000 events/s, but adds up to the whole wait to each event's latency, and the
    CPU matters only near the worker's limit: so busy from `BUSY_RECORDS_PER_WAIT`
    records per wait at the rate of the last `PACE_WINDOW_S` (3,200/s with the default
    5 ms, a quarter to a third of a worker's limit on two cores), idle again below
    `IDLE_RECORDS_PER_WAIT` (the gap keeps a steady rate in one mode). A backlog
    arrives in full fetches back to back and turns busy within one window."""

    def __init__(self, busy_wait_s: float, clock: Callable[[], float] = time.monotonic):
        self._busy_wait_s = busy_wait_s
        self._clock = clock
        self._window_start = clock()
        self._count = 0
        self._busy = False

    def busy(self, count: int) -> bool:
        """Count a fetch of `count` records; whether the next fetch should wait."""
        self._count += count
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed >= PACE_WINDOW_S:
            per_wait = self._count / elapsed * self._busy_wait_s
            threshold = IDLE_RECORDS_PER_WAIT if self._busy else BUSY_RECORDS_PER_WAIT
            self._busy = per_wait >= threshold
            self._window_start, self._count = now, 0
        return self._busy


class BulkConsumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer whose fetch loop hands over whole fetches, and whose
    commit timer sleeps while nothing was acknowledged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acked_since_commit = asyncio.Event()
        self.seeks = 0
        """Seeks of the whole assignment so far (after each assignment, which gives every
        partition a fresh position): a chunk fetched before the last one is stale."""
        self._seeking = asyncio.Lock()

    def acked(self) -> None:
        """Records were acknowledged (`Consumer.ack`): a commit is due within the interval."""
        self._acked_since_commit.set()

    _stabilizing: asyncio.Task | None = None
    _stabilizing_held: frozenset[TP] = frozenset()

    async def seek_to_committed(self) -> Mapping[TP, int | None]:
        """Faust's seek, made after it resumed the assigned partitions and before fetching
        resumes: partitions an open transaction holds (exactly-once) are paused here and
        fetched once it ends, from the offset it leaves.

        One at a time. After a rejoin Faust seeks twice at once (its recovery, and its
        fetch loop while the flow is stopped), and each seek's partitions left out as held
        are the seek's own: read across two seeks, a held partition was fetched from
        aiokafka's own (unstable) position and then sought back once stable, and its
        inputs were answered twice."""
        async with self._seeking:
            was_held = self._stop_stabilizing()
            self.seeks += 1
            if self.app.lost is not None:  # records taken before the seek left out first
                await self.app.lost.take_back(self.assignment())
            offsets = await super().seek_to_committed()
            left_out = self._thread.held  # aiokafka's partitions, as its seek wants them
            held = frozenset(TP(tp.topic, tp.partition) for tp in left_out)
            if held:
                self.pause_partitions(held)
                self._stabilizing = asyncio.ensure_future(self._seek_once_stable(left_out))
                self._stabilizing_held = held
            if was_held - held:  # sought now: the wait that paused them is over
                self.resume_partitions(was_held - held)
            return offsets

    async def on_partitions_revoked(self, revoked: set[TP]) -> None:
        self._stop_stabilizing()
        lost = self.app.lost
        if lost is not None and revoked and self.app.dropped_by_group():
            # Exactly-once, the session lapsed: nothing taken from them can commit now.
            lost.give_up(revoked, self._unacked_messages)
            self._unacked_messages.difference_update(
                [message for message in self._unacked_messages if message.tp in revoked]
            )
        await super().on_partitions_revoked(revoked)

    async def on_stop(self) -> None:
        self._stop_stabilizing()
        await super().on_stop()

    def _stop_stabilizing(self) -> frozenset[TP]:
        """Cancel the wait for held partitions, if any; the partitions it kept paused."""
        if self._stabilizing is None:
            return frozenset()
        self._stabilizing.cancel()
        self._stabilizing = None
        return self._stabilizing_held

    async def _seek_once_stable(self, held: frozenset[Any]) -> None:
        """Wait until no transaction holds the offsets of `held` (`released`), then seek
        them to the committed offsets and resume them. Past its wait the worker ends, as
        when the whole assignment waits."""
        reader = self.app.stable_offsets
        where = [(tp.topic, tp.partition) for tp in held]
        try:
            await released(reader, where)
            offsets = await asyncio.to_thread(reader, where)
        except UnstableOffsets as exc:
            self.app.on_unstable(exc)
        for tp in held:
            offset = offsets[(tp.topic, tp.partition)]
            if offset >= 0:
                await self.seek(tp, offset)
                # As Faust's own seek after an assignment keeps it.
                self._committed_offset[TP(tp.topic, tp.partition)] = offset or None
        self.resume_partitions({TP(tp.topic, tp.partition) for tp in held})
        self._stabilizing = None

    @Service.task
    async def _commit_handler(self) -> None:
        """Faust's commit timer woke every `broker_commit_interval` (100 ms), acks or not:
        idle, that and the loop turns it started were half of the worker's CPU (0.022
        against 0.013 cores with a 1 s interval). Here it waits for an acknowledgement,
        then for the interval, so that one commit covers the acks of an interval, as
        Faust's timer did under load (with no interval, those acknowledged during a
        commit); what a stop or a rebalance commits is unchanged."""
        interval = self.app.commit_wait_s
        pending = self._acked_since_commit
        while not self.should_stop:
            await self.wait(pending.wait())
            if interval:
                await self.sleep(interval)
            if self.should_stop:
                return
            pending.clear()  # before the commit: an ack during it asks for the next one
            await self.commit()

    async def commit(self, *args: Any, **kwargs: Any) -> bool:
        """Faust's commit of the acknowledged offsets; none with exactly-once, where
        each batch's offsets are committed in its transaction (one of Faust's, beside
        them, could move an offset back)."""
        if self.app.stable_offsets is not None:
            return False
        return await super().commit(*args, **kwargs)

    def _new_consumer_thread(self) -> _LoopConsumer:
        return _LoopConsumer(self, loop=self.loop, beacon=self.beacon)

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - Faust's loop
        feeds: dict[str, asyncio.Queue] = self.app.feeds
        consumer_stopped = self._stopped.is_set
        fetcher_stopped = fetcher._stopped.is_set
        try:
            while not (consumer_stopped() or fetcher_stopped()):
                if self._to_pause:  # between fetches only: see `hold`
                    self.pause_partitions(self._to_pause)
                    self._to_pause = frozenset()
                chunks: dict[str, list[Message]] = {}
                others: list[Message] = []
                fetched = 0
                fetch = await self._next_fetch(wait_s=1.0)
                seeks = self.seeks  # the positions these records were fetched from
                for tp, messages in fetch:
                    fetched += len(messages)
                    kept = await self._in_order(tp, messages, seeks)
                    if tp.topic in feeds:
                        chunks.setdefault(tp.topic, []).extend(kept)
                    else:
                        others.extend(kept)
                self._thread.fetched(fetched)
                for topic, messages in chunks.items():
                    await feeds[topic].put(Chunk(messages, seeks))
                for message in others:
                    await self.callback(message)
                await self._commit_if_due()
                await asyncio.sleep(0)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                return
            raise

    async def _next_fetch(self, wait_s: float) -> list[tuple[TP, list[Message]]]:
        """One fetch's records as Faust's messages, by partition: what Faust's `getmany`
        yields, with its checks (flow, generation, active partitions) and its high-water
        tracking made once per fetch and partition instead of once per record. Its
        generator also took each record round-robin across topics, a coroutine step
        apiece, which a feed per topic has no use for. Without that per-record path the
        worker's CPU per event fell from 105-119 to 92-105 µs at 5,000 events/s and from
        370-429 to 327-363 µs at 1,000/s (alternating runs on one broker)."""
        records, active = await self._wait_next_records(wait_s)
        if records is None or self.should_stop:
            return []
        if not self.flow_active:  # as Faust's `getmany`: go back to the committed offsets
            try:
                await self.perform_seek()
            except Exception as exc:
                self.log.warning(f"exception performing seek when flow not active {exc}")
            return []
        to_message = self._to_message
        track_end_offset = self.app.monitor.track_tp_end_offset
        buffered = self._buffered_partitions
        fetch = []
        for tp, fetched in records.items():
            if active is None or tp in active or tp in buffered:
                track_end_offset(tp, self.highwater(tp))
                fetch.append((tp, [to_message(tp, record) for record in fetched]))
        return fetch

    async def _in_order(self, tp: TP, messages: list[Message], seeks: int) -> list[Message]:
        """`messages` of one partition less those read before a seek back (Faust's own
        loop drops them too), their read offsets noted, skipped offsets (compaction,
        transaction markers) committed past. Cut short where the flow stopped or the
        generation changed or a seek was made while a gap was added: Faust's `getmany`
        stops there too, and the read offsets are the seek's.

        A gap is the offsets no record has, `read + 1` to `offset - 1`. Faust's own loop
        passes the next record's offset as the gap's end, which `_add_gap` includes: that
        record, acknowledged too, is then counted twice, and Faust's commits stopped for
        good at the first transaction marker of each partition (committed 8, 6 and 4 of
        30, 23 and 15 records in three transactions). A gap after offset 0 counts too
        (Faust's loop tests the read offset for truth: it skipped that gap, and commits
        stopped for good at offset 1)."""
        read_offsets = self._read_offset
        gaps_matter = self.app.topics.acks_enabled_for(tp.topic)
        generation = self.app.consumer_generation_id
        kept = []
        for message in messages:
            offset, read = message.offset, read_offsets[tp]
            if read is not None and offset < read:
                continue
            if read is not None and offset - read > 1 and gaps_matter:
                await self._add_gap(tp, read + 1, offset - 1)
                if (
                    not self.flow_active
                    or self.app.consumer_generation_id != generation
                    or self.seeks != seeks
                ):
                    return kept
            read_offsets[tp] = offset
            kept.append(message)
        return kept

    def track(self, messages: list[Message]) -> None:
        """Count `messages` as taken and unacked: Faust waits for their acks before a
        rebalance or a stop completes."""
        self._unacked_messages.update(messages)

    _to_pause: frozenset[TP] = frozenset()

    def hold(self, tp: TP, paused: bool) -> None:
        """Stop (True) or restart fetching one partition for its agent. A pause waits for
        the fetch loop's next turn: Faust drops the records a fetch in progress brings
        for a partition paused meanwhile, and, never acknowledged, they would stop the
        partition's commits there (the known trap of `resume_partitions`)."""
        if paused:
            self._to_pause = self._to_pause | {tp}
        elif tp in self._to_pause:
            self._to_pause = self._to_pause - {tp}
        elif tp in self._paused_partitions and self.flow_active:
            # (In a rebalance Faust holds every partition paused, and resumes them itself.)
            self.resume_partitions({tp})

    given_up: tuple[int, frozenset[TP]] = (0, frozenset())
    """(seeks, partitions): partitions whose records waiting for the registry were given
    up since that seek. Their later records, fetched before the next seek, are dropped
    too (`FeedApp.take`): answered, they would be acknowledged (with exactly-once,
    committed) past the records given up."""

    async def wait_empty(self) -> None:
        """Faust's wait for every taken record's ack (a stop, a rebalance), after the
        runners gave up the records they hold for the schema registry: unacknowledged,
        Kafka hands them out again, and neither waits for the registry. Chunks queued
        before the stop or the rebalance are still taken meanwhile (`FeedApp.settle`):
        what their records wait for is given up as it comes."""
        await self._give_up_held()
        self._to_pause = frozenset()  # nothing is held now; Faust resumes what it paused
        unfinished = self.app.on_unfinished
        if unfinished is None:
            giving_up = asyncio.ensure_future(self._keep_giving_up_held())
            try:
                return await super().wait_empty()
            finally:
                giving_up.cancel()
        # Exactly-once: an ack is a committed transaction, which a worker whose group
        # moved on never makes, and Faust's wait has no end (nor can it be cancelled).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.app.conf.broker_session_timeout / 2
        while self._unacked_messages and not self.should_stop:
            if loop.time() > deadline:
                return unfinished(list(self._unacked_messages))
            await asyncio.sleep(0.005)  # acks come as transactions commit
            await self._give_up_held()

    async def _give_up_held(self) -> None:
        for give_up in self.app.holders:
            given_up = await give_up()
            if given_up:
                self._unacked_messages.difference_update(given_up)
                seeks, partitions = self.given_up
                partitions = partitions if seeks == self.seeks else frozenset()
                self.given_up = (self.seeks, partitions | {m.tp for m in given_up})

    async def _keep_giving_up_held(self) -> None:
        # Faust's wait looks at what is unacknowledged at least once a second.
        while True:
            await asyncio.sleep(0.05)
            await self._give_up_held()

    async def _commit_if_due(self) -> None:
        every = self._commit_every
        if every is not None and self._n_acked >= every:
            self._n_acked = 0
            await self.commit()


class BulkTransport(faust_aiokafka.Transport):
    Consumer = BulkConsumer


Unfinished = Callable[[list[Message]], None]


class FeedApp(faust.App):
    """A Faust app whose agents can take their topic's records a fetch at a time."""

    def __init__(
        self,
        *args: Any,
        fetch: tuple[int, int],
        fetch_max_bytes: int,
        commit_wait_s: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.commit_wait_s = commit_wait_s
        """How long after an acknowledgement its offsets are committed (the broker
        config's `commit_interval_ms`; 0: at once)."""
        self.feeds: dict[str, asyncio.Queue[Chunk]] = {}
        self.holders: list[Callable[[], Awaitable[list[Message]]]] = []
        """Each runner's `give_up_held`, called before Faust waits for acks."""
        self.fetch = fetch
        """(fetch_max_wait_ms, fetch_min_bytes) of a busy fetch (the broker config's)."""
        self.fetch_max_bytes = fetch_max_bytes
        """aiokafka's fetch_max_bytes: what one fetch asks in all."""
        self.stable_offsets: StableOffsets | None = None
        """With exactly-once delivery: what reads the offsets Faust seeks to after an
        assignment; Faust then commits nothing itself (`faust_transactions`)."""
        self.on_unstable: Callable[[UnstableOffsets], NoReturn] | None = None
        """With exactly-once delivery: what ends the worker when the offsets of assigned
        partitions stay held by a transaction past `STABLE_WAIT_S`."""
        self.on_unfinished: Unfinished | None = None
        """With exactly-once delivery: what ends the worker when records it took are not
        committed by the time their partitions must go (given those records)."""
        self.lost: LostPartitions | None = None
        """With exactly-once delivery: the partitions given up when the group dropped
        this worker (a lapsed session), until they come back."""

    def dropped_by_group(self) -> bool:
        """Whether the group has dropped this worker: a heartbeat or a commit was told
        that its session lapsed, and aiokafka reset its member id to rejoin. (A rebalance
        the group asks for keeps the member id.)"""
        consumer = self.consumer._thread._consumer  # aiokafka's; None until it starts
        coordinator = getattr(consumer, "_coordinator", None)
        return (
            coordinator is not None and coordinator.member_id == JoinGroupRequest.UNKNOWN_MEMBER_ID
        )

    def add_feed(self, topic: faust.types.TopicT) -> None:
        """Deliver `topic`'s records to `take` instead of a stream; subscribes to it."""
        (name,) = topic.topics
        if name not in self.feeds:
            self.feeds[name] = asyncio.Queue(maxsize=FEED_CHUNKS)
            # Faust subscribes to the topics its conductor holds (a stream adds its
            # topic when first iterated; a fed agent never iterates its stream).
            self.topics.add(topic)

    async def take(self, topic: str) -> Chunk:
        """The next chunk of `topic`'s records, tracked as unacked from here on; chunks
        fetched before the last seek are dropped (`Chunk`), and so are records behind
        records given up to the registry (`BulkConsumer.given_up`). Chunks still queued at a
        stop were never taken: nothing commits them, and the next owner of their
        partitions reads them again."""
        feed, consumer = self.feeds[topic], self.consumer
        while True:
            messages = await feed.get()
            if messages.seeks != consumer.seeks:
                continue  # fetched before a seek moved its partitions: fetched again
            lost = self.lost
            if lost is not None and lost.partitions:
                # Fetched again by their next owner (this worker, maybe).
                messages = Chunk(lost.dropped(messages), messages.seeks)
                if not messages:
                    continue
            seeks, given_up = consumer.given_up
            if given_up and seeks == messages.seeks:
                # Behind records given up to the registry: fetched again after the seek.
                messages = Chunk([m for m in messages if m.tp not in given_up], seeks)
                if not messages:
                    continue
            consumer.track(messages)
            return messages

    async def settle(self, timeout_s: float) -> None:
        """Until every chunk already fetched was taken by its agent and acknowledged
        (at most `timeout_s`): on a rebalance, after Faust paused fetching, so that a
        commit then covers everything the fetch loop handed over."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(not feed.empty() for feed in self.feeds.values()):
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.005)  # the agents take chunks as their runners drain
        await asyncio.wait_for(
            self.consumer.wait_empty(), max(0.0, deadline - asyncio.get_running_loop().time())
        )

    def unfinished(self) -> list[Message]:
        """Records fetched and not yet acknowledged: queued for an agent, or taken; none
        of partitions given up (`lost`)."""
        seeks = self.consumer.seeks
        queued = [message for feed in self.feeds.values() for chunk in feed._queue
                  if chunk.seeks == seeks for message in chunk]  # fmt: skip
        left = queued + list(self.consumer._unacked_messages)
        return left if self.lost is None else self.lost.dropped(left)

    def _new_transport(self) -> BulkTransport:
        return BulkTransport(self.conf.broker_consumer, self)
