"""The bare runtime: the same runners fed by a confluent-kafka consumer, no Faust.

One thread owns the consumer: it polls librdkafka (blocking, GIL released) and hands
records to the event loop. Calls on the consumer from the loop thread can block
behind a poll in progress, so acknowledgements (storing each partition's next
offset, which librdkafka commits in the background and on close) are queued for that
thread, which runs them between polls. The same thread enforces the in-flight bound:
it counts what it handed over and what was acknowledged, and stops handing a topic's
records over at `max_in_flight` (again from `resume_in_flight`), so the bound holds
within one chunk: it stops polling while every input is at its bound, and pauses the
topic's partitions while others flow. A runner can pause one partition (its
records wait for the schema registry): that pause outlasts the bound's resume.
Partitions move with the cooperative-sticky assignor: a rebalance takes away only the
partitions that move, and before they go the poll thread waits (in `on_revoke`) for the
runners to write what it handed over from them, and commits it, so their next owner
repeats nothing; the partitions that stay keep flowing.
It exists to measure what Faust costs and as a leaner choice (`runtime: bare`).

With `delivery: exactly_once` nothing is stored or committed here: each batch's offsets
go into the transaction that writes its outcomes (`streams/transact.py`), sent with the
consumer's group metadata, which the poll thread reads for the publisher. A partition
revoked before the transactions of what was handed over from it are committed ends
the worker (exit 70): committing them later could repeat its next owner's answers.
One the group took away (a session that lapsed: a broker away, this process frozen)
is given up instead: those answers are left out of every later transaction, and its
next owner answers them, this worker included once they are all left out. librdkafka
keeping partitions the group took away (a session that lapsed during a rebalance:
`streams/membership.py`) ends the worker too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NoReturn

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from infra.kafka_clients import client_settings
from streams.backpressure import InFlight
from streams.config import HeadraceConfig
from streams.drain import DrainDeadline
from streams.health import Health
from streams.lag import CommittedOffsets, ConfluentMarks, InputProgress
from streams.membership import CHECK_EVERY_S, Membership, PartitionsKept
from streams.publish import LOST_WAIT_S
from streams.records import InputRecord, partition_names
from streams.replay import AnsweredBefore
from streams.runner import MakeRunner, PipelineRunner
from streams.transact import TransactionalPublisher, UnfinishedRevoke

log = logging.getLogger(__name__)

# How long a poll waits for a record (it returns as soon as one comes). Between polls
# the poll thread stores acknowledged offsets, so it waits briefly while any record is
# handed over and unacknowledged; with none, only a stop waits on it: an idle worker
# then wakes 5 times a second instead of 20. (Not longer: confluent-kafka cuts a wait
# over 200 ms into chunks, a path whose producer poll waits out its whole timeout even
# after serving a report; both clients stay on the plain path, see `streams/publish.py`.)
BUSY_POLL_S = 0.05
IDLE_POLL_S = 0.2
# With a commit on each acknowledgement (`broker.commit_interval_ms: 0`), the wait while
# records are unacknowledged: the last batch of a burst is committed within it.
COMMIT_POLL_S = 0.005
# How long a commit in flight holds the next one back; past it the next one goes anyway,
# so that a result librdkafka never reported cannot stop the commits for good.
COMMIT_HOLD_S = 5.0


class BareConsumer:
    """Consumes the pipelines' input topics and dispatches records to their runners."""

    def __init__(
        self,
        config: HeadraceConfig,
        make_runner: MakeRunner,
        health: Health,
        transactions: TransactionalPublisher | None = None,
        on_fatal: Callable[[BaseException, Sequence[InputRecord]], NoReturn] | None = None,
        answered_before: AnsweredBefore | None = None,
    ) -> None:
        bootstrap, timeout_s = config.broker.bootstrap_servers, config.broker.connect_timeout_s
        fetch_wait_ms, fetch_min_bytes = config.broker.fetching("bare")
        self._consumer = Consumer(
            {
                **client_settings(bootstrap, "consumer", timeout_s),
                "group.id": config.app_id,
                "auto.offset.reset": "earliest",
                # Commit only what the runners acknowledged (stored), in the background;
                # exactly-once commits each batch's offsets in its transaction instead.
                "enable.auto.commit": transactions is None,
                "enable.auto.offset.store": False,
                # 0 turns librdkafka's timer off: each acknowledgement commits instead.
                "auto.commit.interval.ms": config.broker.commit_interval_ms,
                "on_commit": self._committed,
                "partition.assignment.strategy": "cooperative-sticky",
                "session.timeout.ms": config.broker.session_timeout_ms,
                "heartbeat.interval.ms": config.broker.heartbeat_interval_ms,
                **(
                    {"group.instance.id": config.broker.instance_id}
                    if config.broker.instance_id
                    else {}
                ),
                "topic.metadata.refresh.interval.ms": config.broker.metadata_refresh_ms,
                # Bound librdkafka's own prefetch buffer too (KiB per partition).
                "queued.max.messages.kbytes": 8192,
                "fetch.wait.max.ms": fetch_wait_ms,
                "fetch.min.bytes": fetch_min_bytes,
                # Soft bounds: a larger record still comes, whole, as a fetch of its own.
                "max.partition.fetch.bytes": config.broker.max_partition_fetch_bytes,
                "fetch.max.bytes": config.broker.fetch_max_bytes,
            }
        )
        # Commit on each acknowledgement (`broker.commit_interval_ms: 0`); poll thread's.
        self._commit_on_ack = transactions is None and config.broker.commit_interval_ms == 0
        self._committing_since: float | None = None
        self._commit_again = False
        self._busy_poll_s = COMMIT_POLL_S if self._commit_on_ack else BUSY_POLL_S
        self._max_chunk = max(p.max_batch_size for p in config.pipelines)
        self._runners: dict[str, PipelineRunner] = {}
        # Per input topic, owned by the poll thread: records handed over, not yet acked.
        self._handed_over: dict[str, int] = {}
        # The same per partition: what a revoked partition must finish before it goes.
        self._unwritten: Counter[tuple[str, int]] = Counter()
        # Exactly-once: lost partitions whose uncommitted answers the publisher leaves
        # out (`_finish_lost`); their counts above fall to 0 as those are left out.
        self._given_up: set[tuple[str, int]] = set()
        # Partitions revoked or lost while a poll's records were taken (poll thread's).
        self._revoked_in_poll: set[tuple[str, int]] = set()
        self._revoke_timeout_s = config.broker.session_timeout_ms / 1000
        self._bounds: dict[str, tuple[int, int]] = {}
        # Input topics at their in-flight bound, and those paused in librdkafka for it
        # (only while another topic flows: see `_apply_bounds`).
        self._paused: set[str] = set()
        self._fetch_paused: set[str] = set()
        self._progress = {spec.input_topic: InputProgress(spec.name) for spec in config.pipelines}
        committed = CommittedOffsets(client_settings(bootstrap, "lag", timeout_s), config.app_id)
        self._marks = ConfluentMarks(self._consumer, self._progress, committed.ask)
        # Partitions a runner paused (records waiting for the registry); poll thread's.
        self._held: set[tuple[str, int]] = set()
        for spec in config.pipelines:
            topic = spec.input_topic
            # The poll thread pauses fetching; this one keeps the metrics.
            in_flight = InFlight(spec.name, spec.max_in_flight, spec.resume_at)
            self._runners[topic] = make_runner(
                spec.name, in_flight, self._store_offsets, self._hold_partition
            )
            self._handed_over[topic] = 0
            self._bounds[topic] = (spec.max_in_flight, spec.resume_at)
        self._stopping = threading.Event()
        self._health = health
        self._drain_timeout_s = config.drain_timeout_s
        self._transactions = transactions
        if transactions is not None and on_fatal is None:
            raise ValueError("exactly-once needs on_fatal: a worker that must not commit ends")
        self._on_fatal = on_fatal
        self._answered_before = answered_before
        # Exactly-once: the member id of the assignment, checked for librdkafka keeping
        # partitions the group took away (`streams/membership.py`); used by the thread
        # that owns the consumer (the poll thread; the loop's once it ended).
        self._membership = Membership()
        self._membership_checked_at = 0.0
        # Whether the poll thread runs `_calls` (else they run where they are made).
        self._polling = True
        if transactions is not None:
            transactions.attach(self.group_metadata)
        # Consumer calls from the loop thread, run by the poll thread between polls.
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    async def serve(self) -> None:
        """Run until SIGTERM or SIGINT, then, within `drain_timeout_s`: stop fetching,
        drain every runner, commit and leave the group."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        for runner in self._runners.values():
            await runner.start()
            self._health.serving(loop, runner.name, lambda runner=runner: runner.unanswered)
        self._consumer.subscribe(
            list(self._runners),
            on_assign=self._assigned,
            on_revoke=self._finish_revoked,
            on_lost=self._finish_lost,
        )
        poller = threading.Thread(target=self._poll, args=(loop,), name="kafka-consumer")
        self._loop, self._poller = loop, poller
        poller.start()
        try:
            await stop.wait()
        finally:
            self._health.draining()
            deadline = DrainDeadline(self._drain_timeout_s)
            self._stopping.set()
            await loop.run_in_executor(None, poller.join)
            self._polling = False
            self._run_queued_calls()  # made while the poll thread was ending
            try:
                await asyncio.wait_for(self._drain(), deadline.drain_left_s())
            except TimeoutError:
                left = sum(runner.in_flight.count for runner in self._runners.values())
                log.warning("drain_timeout_s: %d records not answered in time, left to the "
                            "next owner of their partitions", left)  # fmt: skip
            for runner in self._runners.values():
                await runner.stop()
            # The drained batches queued their offsets for the poll thread, which is gone:
            # store them here (nothing polls any more), so the close commits them.
            self._run_queued_calls()
            if self._commit_on_ack:  # no timer's commit at the close: commit them here
                with contextlib.suppress(KafkaException):  # nothing new stored
                    self._consumer.commit(asynchronous=False)
            self._consumer.close()  # commits the stored offsets, leaves the group
            deadline.met()

    async def _drain(self) -> None:
        for runner in self._runners.values():
            self._forget(await runner.drain())  # held for the registry: not waited for

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stopping.is_set():
            self._health.turned()
            self._check_membership_now_and_then()
            self._run_queued_calls()
            self._apply_bounds()
            self._marks.refresh()
            if self._every_input_at_bound:
                # Everything paused: wait for acknowledgements instead of polling.
                with contextlib.suppress(queue.Empty):
                    self._calls.get(timeout=0.05)()
                continue
            handed_over = any(self._handed_over.values())
            first = self._consumer.poll(self._busy_poll_s if handed_over else IDLE_POLL_S)
            if first is None:
                continue
            messages = self._with_what_is_here(first)
            for message in messages:
                if not message.error():
                    self._handed_over[message.topic()] += 1
                    self._unwritten[(message.topic(), message.partition())] += 1
            loop.call_soon_threadsafe(self._dispatch, messages)
        self._run_queued_calls()

    def _with_what_is_here(self, first: Message) -> list[Message]:
        """`first` and the records already fetched after it (taken without waiting: no
        added latency), less those of partitions revoked meanwhile. A revoke served
        inside `consume` finished its partitions (waited for what was handed over, then
        committed) without `first`, not handed over yet: their next owner reads such
        records again from the committed offsets, so they are not answered here."""
        self._revoked_in_poll.clear()
        messages = [first, *self._consumer.consume(self._max_chunk - 1, 0)]
        gone = self._revoked_in_poll
        if gone:
            messages = [m for m in messages if (m.topic(), m.partition()) not in gone]
        return messages

    def _apply_bounds(self) -> None:
        for topic, (high, low) in self._bounds.items():
            # Records held for the registry pause their own partitions (`streams/holds.py`).
            count = self._handed_over[topic] - self._runners[topic].in_flight.held
            if topic not in self._paused and count >= high:
                self._paused.add(topic)
            elif topic in self._paused and count <= low:
                self._paused.discard(topic)
        if self._every_input_at_bound:
            # Nothing is polled until one resumes: librdkafka keeps what it prefetched
            # (queued.max.messages.kbytes bounds it). A pause would drop all of it, and
            # the resume fetch it again: megabytes per cycle, a third of the throughput
            # of a backlog on a slow model.
            return
        for topic in self._paused - self._fetch_paused:
            self._fetch_paused.add(topic)
            self._pause(topic, True)
        for topic in self._fetch_paused - self._paused:
            self._fetch_paused.discard(topic)
            self._pause(topic, False)

    @property
    def _every_input_at_bound(self) -> bool:
        return len(self._paused) == len(self._runners)

    def _run_queued_calls(self) -> None:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            call()

    def _dispatch(self, messages: list[Message]) -> None:
        by_topic: dict[str, list[Message]] = {}
        for message in messages:
            if message.error():
                log.warning("consumer error: %s", message.error())
                continue
            by_topic.setdefault(message.topic(), []).append(message)
        for topic, batch in by_topic.items():
            records = [_input_record(m) for m in batch]
            self._progress[topic].read(records)
            self._runners[topic].submit(
                records, [(r.topic, r.partition, r.offset) for r in records]
            )

    def _store_offsets(self, handles: list[tuple[str, int, int]]) -> None:
        """Queue the next offset of each partition of a written batch (handles are in order)."""
        latest: dict[tuple[str, int], int] = {}
        for topic, partition, offset in handles:
            latest[(topic, partition)] = offset
        offsets = [TopicPartition(t, p, o + 1) for (t, p), o in latest.items()]
        topic = handles[0][0]
        self._progress[topic].answered(latest)

        def store() -> None:
            self._handed_over[topic] -= len(handles)
            self._unwritten.subtract((t, p) for t, p, _ in handles)
            if self._transactions is not None:
                return  # committed in the batch's transaction
            try:
                self._consumer.store_offsets(offsets=offsets)
            except KafkaException as exc:
                # The partition was revoked meanwhile: its new owner answers these again.
                log.warning("could not store offsets %s: %s", offsets, exc)
                return
            if self._commit_on_ack:
                self._commit_stored()

        self._calls.put(store)

    def _commit_stored(self) -> None:
        """Poll thread: commit the stored offsets now, or once the commit in flight ends
        (`_committed`), so that one commit carries what was acknowledged meanwhile."""
        since = self._committing_since
        now = time.monotonic()
        if since is not None and now - since < COMMIT_HOLD_S:
            self._commit_again = True
            return
        self._committing_since, self._commit_again = now, False
        self._consumer.commit(asynchronous=True)

    def _committed(self, error: KafkaError | None, _partitions: list[TopicPartition]) -> None:
        """Poll thread, inside `poll`: a commit ended (librdkafka's own ones too)."""
        if error is not None and error.code() != KafkaError._NO_OFFSET:
            log.debug("commit: %s", error)
        if self._committing_since is not None:
            self._committing_since = None
            if self._commit_again:
                self._commit_stored()

    def _assigned(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Poll thread, inside `poll`, before any record of `partitions` is returned:
        the inputs past their committed offsets already answered are handed to the
        runners first (queued on the loop ahead of the records)."""
        self._health.joined(True)
        if self._transactions is not None:
            self._take_back([(tp.topic, tp.partition) for tp in partitions])
            holding = bool(partitions) or bool(self._consumer.assignment())
            self._checked_metadata(lambda metadata: self._membership.assigned(metadata, holding))
        if self._answered_before is None or not partitions:
            return
        found = self._answered_before.scan((tp.topic, tp.partition) for tp in partitions)
        for topic, runner in self._runners.items():
            mine = {where: offsets for where, offsets in found.items() if where[0] == topic}
            if mine:
                self._loop.call_soon_threadsafe(runner.answered_before, mine)

    def _finish_revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Poll thread, inside `poll`, before `partitions` go to another member: wait
        for the runners to write what was handed over from them (their acks arrive as
        queued calls), then commit, so the next owner starts after the last answer."""
        if self._transactions is not None:
            # A revoke under a new member id: librdkafka kept these across a lapse.
            self._checked_metadata(self._membership.check)
        self._finish(partitions, self._revoke_timeout_s)
        held = {(tp.topic, tp.partition) for tp in consumer.assignment()}
        if not held - {(tp.topic, tp.partition) for tp in partitions}:
            self._membership.released()
        try:
            consumer.commit(asynchronous=False)
        except KafkaException as exc:  # nothing stored since the last commit, mostly
            log.debug("commit on revoke: %s", exc)

    def _finish_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Poll thread, inside `poll`: the group took `partitions` away without us (our
        session lapsed: the broker down, or this process frozen), so nothing committed
        now counts. If they come back to this worker, its read-back at the assignment
        must see every answer it still writes for them, or it answers those inputs again
        (a broker killed for 10 s: 8-10 repeats in about one run in six while this waited
        only a session). So wait as long as an answer can wait for Kafka; the group
        cannot be rejoined before the broker is back anyway, and then they go at once.

        With exactly-once there is nothing to wait for that long: the group refuses
        offsets from a member it dropped, and this one cannot rejoin while it waits
        here, so only a transaction whose offsets the group took before that can still
        commit. Wait half a session for it (as the Faust runtime waits on a revoke).
        What is left is given up: the publisher leaves those answers and their offsets
        out of every later transaction, so none commits them under a later generation
        while another member owns them, and their next owner answers those inputs (this
        worker, once `_take_back` let them all go: a broker away longer than the session
        is ridden out)."""
        self._health.lost_group()
        eos = self._transactions is not None
        self._finish(partitions, self._revoke_timeout_s / 2 if eos else LOST_WAIT_S, eos)
        self._membership.released()

    def _take_back(self, assigned: list[tuple[str, int]]) -> None:
        """Poll thread, at an assignment under exactly-once: partitions given up when
        the group took them away come back once every record taken from them before is
        left out (their acks ran), so that no new record of theirs is left out with them.
        That waits at most for a transaction attempt; one that outlasts `LOST_WAIT_S`
        ends the worker (exit 70) rather than answer those inputs twice."""
        back = [tp for tp in assigned if tp in self._given_up]
        if not back:
            return
        deadline = time.monotonic() + LOST_WAIT_S
        while any(self._unwritten[tp] > 0 for tp in back) and time.monotonic() < deadline:
            self._health.turned()
            with contextlib.suppress(queue.Empty):
                self._calls.get(timeout=0.05)()
        left = sum(max(0, self._unwritten[tp]) for tp in back)
        if left:
            self._on_fatal(UnfinishedRevoke(left, back), [])
            return
        self._transactions.take_back(back)
        self._given_up.difference_update(back)
        log.info("%s back: their answers go in transactions again", partition_names(sorted(back)))
        for tp in back:
            del self._unwritten[tp]

    def _finish(
        self, partitions: list[TopicPartition], timeout_s: float, give_up: bool = False
    ) -> None:
        """Wait up to `timeout_s` for what was handed over from `partitions` to be
        written, running the loop's queued calls (acks) meanwhile. Under exactly-once,
        what is left ends the worker, or with `give_up` is left out of transactions."""
        self._health.revoked()
        revoked = [(tp.topic, tp.partition) for tp in partitions]
        self._revoked_in_poll.update(revoked)
        self._give_up_held(revoked)
        if self._closing():
            # The drain ran out of time and the runners are stopped: nothing more is
            # written. Waiting would only run past the drain deadline (exit 70) before
            # the group is left; their next owner answers what is left.
            timeout_s = 0.0
        deadline = time.monotonic() + timeout_s
        while any(self._unwritten[tp] > 0 for tp in revoked) and time.monotonic() < deadline:
            self._health.turned()  # waiting on acks is not a stuck poll loop
            with contextlib.suppress(queue.Empty):
                self._calls.get(timeout=0.05)()
        left = sum(max(0, self._unwritten[tp]) for tp in revoked)
        if left and self._transactions is not None and not self._closing():  # on_fatal set
            if give_up:
                unfinished = [tp for tp in revoked if self._unwritten[tp] > 0]
                self._transactions.give_up(unfinished)
                self._given_up.update(unfinished)
                log.warning("%d records of partitions the group took away were not "
                            "committed: their answers are left out of every transaction, "
                            "and their next owner answers them", left)  # fmt: skip
                for tp in set(revoked) - set(unfinished):
                    del self._unwritten[tp]
                return
            self._on_fatal(UnfinishedRevoke(left, revoked), [])
        if left:
            log.warning("%d records of revoked partitions not written in time: their "
                        "next owner answers them again", left)  # fmt: skip
        for tp in revoked:
            del self._unwritten[tp]

    async def group_metadata(self) -> bytes:
        """The consumer's group metadata (for offsets sent to a transaction), read by the
        poll thread: from another thread the call would wait behind a poll."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bytes] = loop.create_future()

        def read() -> None:
            metadata = self._checked_metadata(self._membership.check)
            loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(metadata))

        if self._polling:
            self._calls.put(read)
        else:
            read()  # nothing polls any more (the final drain)
        return await answer

    def _check_membership_now_and_then(self) -> None:
        """Poll thread, every `CHECK_EVERY_S` under exactly-once: `_checked_metadata`."""
        if self._transactions is None:
            return  # at least once marks what a lapsed session may repeat (streams/freeze.py)
        now = time.monotonic()
        if now - self._membership_checked_at >= CHECK_EVERY_S:
            self._membership_checked_at = now
            self._checked_metadata(self._membership.check)

    def _checked_metadata(self, check: Callable[[bytes], None]) -> bytes:
        """The consumer's group metadata, once `check` found that librdkafka kept no
        partitions the group took away; where it did (`streams/membership.py`), the
        worker ends (exit 70) before it commits anything more. On the thread that owns
        the consumer."""
        metadata = self._consumer.consumer_group_metadata()
        try:
            check(metadata)
        except PartitionsKept as exc:
            self._on_fatal(exc, [])  # set: the constructor refuses exactly-once without it
        return metadata

    def _give_up_held(self, revoked: list[tuple[str, int]]) -> None:
        """Poll thread, before `revoked` go: the records the runners hold from them for
        the schema registry are given up (their next owner reads them), so the revoke
        does not wait for the registry; a held partition is resumed before it goes."""
        if self._closing():  # drained already
            return
        self._run_queued_calls()  # pauses asked for before
        for topic, partition in revoked:
            if (topic, partition) in self._held:
                self._held.discard((topic, partition))
                self._consumer.resume([TopicPartition(topic, partition)])
        for runner in self._runners.values():
            given_up = asyncio.run_coroutine_threadsafe(runner.give_up_held(revoked), self._loop)
            try:
                self._forget(given_up.result(timeout=self._revoke_timeout_s))
            except TimeoutError:
                log.warning("records held for the registry not given up in time")

    def _closing(self) -> bool:
        """Whether a rebalance callback runs inside the final `close()` (on the loop's
        thread, the poll thread gone), not inside a poll."""
        return threading.current_thread() is not self._poller

    def _forget(self, handles: list[tuple[str, int, int]]) -> None:
        """Count records given up (unanswered, unacknowledged) as no longer handed over."""
        for topic, partition, _ in handles:
            self._handed_over[topic] -= 1
            self._unwritten[(topic, partition)] -= 1

    def _pause(self, topic: str, paused: bool) -> None:
        """Pause or resume a topic's assigned partitions, except held ones (poll thread only)."""
        partitions = [
            tp for tp in self._consumer.assignment()
            if tp.topic == topic and (paused or (topic, tp.partition) not in self._held)
        ]  # fmt: skip
        if partitions:
            (self._consumer.pause if paused else self._consumer.resume)(partitions)

    def _hold_partition(self, topic: str, partition: int, paused: bool) -> None:
        """Pause or resume one partition for its runner; queued for the poll thread.
        librdkafka drops what it prefetched of a paused partition and fetches again
        from the next offset not yet handed over when it resumes."""

        def hold() -> None:
            (self._held.add if paused else self._held.discard)((topic, partition))
            if paused or topic not in self._fetch_paused:  # else the bound's resume restarts it
                call = self._consumer.pause if paused else self._consumer.resume
                try:
                    call([TopicPartition(topic, partition)])
                except KafkaException as exc:  # no longer assigned: nothing to pause
                    log.warning("could not %s %s[%d]: %s",
                                "pause" if paused else "resume", topic, partition, exc)  # fmt: skip

        self._calls.put(hold)


def _input_record(message: Message) -> InputRecord:
    return InputRecord(
        topic=message.topic(),
        partition=message.partition(),
        offset=message.offset(),
        timestamp_ms=message.timestamp()[1],
        key=message.key(),
        value=message.value(),
        headers=message.headers() or (),
    )
