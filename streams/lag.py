"""Consumer lag per input partition and the age of the oldest unanswered input.

A partition's lag is the records between the first input this worker has still to
answer there and the partition's high-water mark (the offset the next record written
gets):

    lag = high-water mark - offset of the first record read and not yet answered
        = high-water mark - next offset to read            (nothing in hand)
        = high-water mark - the consumer's position         (nothing read yet)

At rest it is what Kafka's consumer-groups tool shows (log-end offset minus committed
offset): every answered offset is committed within `broker.commit_interval_ms`. While
the worker works, it counts records fetched and waiting for a batch as lag, and none
that were answered but not yet committed.

High-water marks are the consumer's own, which every fetch response refreshes at no
cost. A partition not being fetched (paused by backpressure or a stall) would keep a
stale one: when a lagging partition's mark has not moved for `QUERY_AFTER_S`, the
consumer asks the broker for it (one ListOffsets request for such partitions), at most
that often.

The oldest unanswered input is the first record of each partition read and not yet
answered (acknowledgements go in offset order per partition); its age is taken from its
Kafka timestamp when the metric is read. Records still in Kafka count in the lag, not
here.

`read` and `answered` run on the event loop, `update` where the consumer is driven
(the bare runtime's poll thread, the Faust runtime's loop), the gauges are read by the
metrics server's thread: one lock guards the state, held for a few dict operations.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter, itemgetter
from typing import Any

from streams import metrics
from streams.records import InputRecord

log = logging.getLogger(__name__)

REFRESH_S = 1.0
"""How often a consumer hands its high-water marks and positions to the progress."""
QUERY_AFTER_S = 5.0
"""A lagging partition's high-water mark unchanged this long is asked of the broker."""
QUERY_TIMEOUT_S = 2.0
"""The longest a consumer waits for the broker's answer to such a question."""

TP = tuple[str, int]
_offset = attrgetter("offset")
_topic_partition = itemgetter(0, 1)


@dataclass(slots=True)
class _Partition:
    unanswered: deque[list[InputRecord]] = field(default_factory=deque)
    """Runs of records read and not yet answered, in offset order."""
    first: int = 0
    """Index in `unanswered[0]` of its first unanswered record."""
    next_read: int | None = None
    position: int | None = None
    """The consumer's position, which counts only while nothing was read."""
    high_water: int | None = None
    moved_s: float = 0.0
    """When `high_water` last changed (monotonic)."""
    asked_s: float = float("-inf")
    """When the broker was last asked for the high-water mark (monotonic)."""

    def next_to_answer(self) -> int | None:
        if self.unanswered:
            return self.unanswered[0][self.first].offset
        return self.next_read if self.next_read is not None else self.position

    def lag(self) -> int | None:
        start = self.next_to_answer()
        if start is None or self.high_water is None:
            return None
        return max(0, self.high_water - start)

    def forget_from(self, offset: int) -> None:
        """Drop what was read at or after `offset` (read again after a seek back)."""
        kept: deque[list[InputRecord]] = deque()
        for run in self.unanswered:
            if run[0].offset >= offset:
                break
            kept.append(run[: bisect_right(run, offset - 1, key=_offset)])
        first = self.first
        if kept and first >= len(kept[0]):  # what is left of it was answered
            kept.popleft()
            first = 0
        self.unanswered, self.first = kept, first if kept else 0


class InputProgress:
    """One pipeline's input partitions as this worker holds them: what it read, what
    it answered, their high-water marks. Exports the lag of each assigned partition
    and the age of the oldest unanswered input as gauges read at scrape time."""

    def __init__(
        self,
        pipeline: str,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pipeline = pipeline
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._partitions: dict[TP, _Partition] = {}
        self._exported: set[TP] = set()
        metrics.OLDEST_UNANSWERED.labels(pipeline).set_function(self.oldest_unanswered_s)

    def read(self, records: Sequence[InputRecord]) -> None:
        """Records handed to the pipeline (in offset order per partition). Never blocks."""
        with self._lock:
            for tp, run in groupby(records, key=_topic_partition):
                state = self._partitions.get(tp)
                if state is None:
                    state = self._partitions[tp] = _Partition()
                run = list(run)
                if state.next_read is not None and run[0].offset < state.next_read:
                    state.forget_from(run[0].offset)
                state.unanswered.append(run)
                state.next_read = run[-1].offset + 1

    def answered(self, last: Mapping[TP, int]) -> None:
        """Every record up to `last[tp]` (the last offset answered) of each partition is
        answered. Never blocks."""
        with self._lock:
            for tp, offset in last.items():
                state = self._partitions.get(tp)
                if state is None:
                    continue  # no longer assigned
                runs = state.unanswered
                while runs and runs[0][-1].offset <= offset:
                    runs.popleft()
                    state.first = 0
                if runs:
                    state.first = bisect_right(runs[0], offset, lo=state.first, key=_offset)

    def update(self, marks: Mapping[TP, tuple[int | None, int | None]]) -> None:
        """The consumer's assigned partitions of this pipeline with their high-water mark
        and position (None, or a negative offset: unknown); other partitions are
        forgotten."""
        now = self._monotonic()
        with self._lock:
            for tp in [tp for tp in self._partitions if tp not in marks]:
                del self._partitions[tp]
            for tp in [tp for tp in self._exported if tp not in marks]:
                self._exported.discard(tp)
                metrics.CONSUMER_LAG.remove(self.pipeline, tp[0], str(tp[1]))
            for tp, (high_water, position) in marks.items():
                state = self._partitions.get(tp)
                if state is None:
                    state = self._partitions[tp] = _Partition()
                self._set_high_water(state, high_water, now)
                if position is not None and position >= 0:
                    state.position = position
                if tp not in self._exported and state.lag() is not None:
                    self._exported.add(tp)
                    child = metrics.CONSUMER_LAG.labels(self.pipeline, tp[0], str(tp[1]))
                    child.set_function(lambda tp=tp: self.lag(tp) or 0)

    def queried(self, high_waters: Mapping[TP, int | None]) -> None:
        """High-water marks the broker answered (for the partitions `stale` named)."""
        now = self._monotonic()
        with self._lock:
            for tp, high_water in high_waters.items():
                state = self._partitions.get(tp)
                if state is not None:
                    state.asked_s = now
                    self._set_high_water(state, high_water, now)

    def stale(self) -> list[TP]:
        """Partitions whose high-water mark should be asked of the broker: it has not
        moved for `QUERY_AFTER_S` while they lag (probably not being fetched), and the
        broker was not asked within `QUERY_AFTER_S`."""
        now = self._monotonic()
        with self._lock:
            return [
                tp for tp, state in self._partitions.items()
                if (state.lag() or 0) > 0
                and now - state.moved_s >= QUERY_AFTER_S
                and now - state.asked_s >= QUERY_AFTER_S
            ]  # fmt: skip

    def unplaced(self) -> list[TP]:
        """Assigned partitions with nothing read and no position known yet."""
        with self._lock:
            return [
                tp for tp, state in self._partitions.items()
                if state.next_to_answer() is None
            ]  # fmt: skip

    def lag(self, tp: TP) -> int | None:
        with self._lock:
            state = self._partitions.get(tp)
            return None if state is None else state.lag()

    def lags(self) -> dict[TP, int]:
        with self._lock:
            found = {tp: state.lag() for tp, state in self._partitions.items()}
        return {tp: lag for tp, lag in found.items() if lag is not None}

    def oldest_unanswered_s(self) -> float:
        with self._lock:
            oldest = min(
                (s.unanswered[0][s.first].timestamp_ms for s in self._partitions.values()
                 if s.unanswered),
                default=None,
            )  # fmt: skip
        return 0.0 if oldest is None else max(0.0, self._clock() - oldest / 1000)

    @staticmethod
    def _set_high_water(state: _Partition, high_water: int | None, now: float) -> None:
        # Marks only grow: a cached one older than the broker's answer does not count.
        if high_water is not None and high_water > (state.high_water or -1):
            state.high_water = high_water
            state.moved_s = now


# The consumer runtimes ------------------------------------------------------------


class ConfluentMarks:
    """Reads a confluent-kafka consumer's marks into each input topic's progress.

    `refresh()` is called by the thread that polls the consumer (a call from another
    thread would wait behind a poll), as often as it likes: it acts every `REFRESH_S`.
    The cached high-water marks and the positions are local; the broker is asked only
    for a stale mark (see the module docstring) and for the committed offset of a
    partition assigned and idle since (librdkafka knows no position before it delivers
    a record). The committed offsets are asked through `ask_committed`, whose answer is
    taken at a later refresh: under read_committed the consumer's own `committed()`
    waits for any transaction holding a partition's offset (another worker's, until
    Kafka ends it), and the poll thread must not wait with it."""

    def __init__(
        self,
        consumer: Any,
        progress: Mapping[str, InputProgress],
        ask_committed: Callable[[list[TP]], Future[dict[TP, int]]],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consumer = consumer
        self._progress = progress
        self._ask_committed = ask_committed
        self._asked: Future[dict[TP, int]] | None = None
        self._monotonic = monotonic
        self._due_s = monotonic()

    def refresh(self) -> None:
        now = self._monotonic()
        if now < self._due_s:
            return
        self._due_s = now + REFRESH_S
        from confluent_kafka import KafkaException

        try:
            self._refresh()
        except (KafkaException, RuntimeError) as exc:  # closed, or between assignments
            log.debug("consumer lag not refreshed: %s", exc)

    def _refresh(self) -> None:
        from confluent_kafka import TopicPartition

        consumer = self._consumer
        marks: dict[str, dict[TP, tuple[int | None, int | None]]] = {
            topic: {} for topic in self._progress
        }
        for tp in consumer.position(consumer.assignment()):
            if tp.topic in marks:
                _low, high = consumer.get_watermark_offsets(tp, cached=True)
                marks[tp.topic][(tp.topic, tp.partition)] = (high, tp.offset)
        committed = self._committed()
        unplaced: list[TP] = []
        for topic, progress in self._progress.items():
            progress.update(marks[topic])
            idle = progress.unplaced()
            placed = {tp: committed[tp] for tp in idle if tp in committed}
            if placed:
                progress.update({**marks[topic], **placed})
            unplaced += [tp for tp in idle if tp not in placed]
            stale = progress.stale()
            if stale:
                asked = consumer.offsets_for_times(
                    [TopicPartition(t, p, -1) for t, p in stale], timeout=QUERY_TIMEOUT_S
                )  # timestamp -1: the latest offset, i.e. the high-water mark
                progress.queried({(tp.topic, tp.partition): tp.offset for tp in asked})
        if unplaced and self._asked is None:
            self._asked = self._ask_committed(unplaced)

    def _committed(self) -> dict[TP, tuple[int | None, int | None]]:
        """The marks of the partitions the last ask answered for, once it has answered
        ({} until then, or when it failed: the next refresh asks again)."""
        if self._asked is None or not self._asked.done():
            return {}
        asked, self._asked = self._asked, None
        try:
            offsets = asked.result()
        except Exception as exc:  # the broker away, the group's coordinator moving
            log.debug("committed offsets not read: %s", exc)
            return {}
        from confluent_kafka import TopicPartition

        consumer = self._consumer
        marks: dict[TP, tuple[int | None, int | None]] = {}
        for (topic, partition), start in offsets.items():
            tp = TopicPartition(topic, partition)
            if start < 0:  # nothing committed: `auto.offset.reset` is earliest
                start, _high = consumer.get_watermark_offsets(tp, timeout=QUERY_TIMEOUT_S)
            high = consumer.get_watermark_offsets(tp, cached=True)[1]
            marks[(topic, partition)] = (high, start)
        return marks


class CommittedOffsets:
    """A group's committed offsets, asked with the admin API: the answer is a future,
    and it leaves out offsets an open transaction holds (`require_stable` off), where the
    consumer's own read waits for that transaction to end. Its client is made at the
    first ask."""

    def __init__(self, settings: Mapping[str, Any], group: str) -> None:
        self._settings = dict(settings)
        self._group = group
        self._admin: Any = None

    def ask(self, partitions: list[TP]) -> Future[dict[TP, int]]:
        from confluent_kafka.admin import AdminClient

        from infra.kafka_clients import ask_group_offsets

        if self._admin is None:
            self._admin = AdminClient(self._settings)
        answer = ask_group_offsets(
            self._admin, self._group, partitions, require_stable=False, timeout_s=QUERY_TIMEOUT_S
        )
        offsets: Future[dict[TP, int]] = Future()

        def answered(done: Future) -> None:
            try:
                found = done.result().topic_partitions
                offsets.set_result({(tp.topic, tp.partition): tp.offset for tp in found})
            except Exception as exc:
                offsets.set_exception(exc)

        answer.add_done_callback(answered)
        return offsets


async def refresh_faust(consumer: Any, progress: Mapping[str, InputProgress]) -> None:
    """Read a Faust (aiokafka) consumer's marks into each input topic's progress; on
    the event loop, every `REFRESH_S` (a Faust timer). Cached high-water marks are
    read directly; positions and stale marks are asked through Faust's consumer
    thread with bounded waits. Never raises (a timer that raised would end the app)."""
    try:
        await _refresh_faust(consumer, progress)
    except Exception as exc:  # not started, rebalancing, broker unreachable
        log.debug("consumer lag not refreshed: %r", exc)


async def _refresh_faust(consumer: Any, progress: Mapping[str, InputProgress]) -> None:
    assignment = consumer.assignment()
    for topic, topic_progress in progress.items():
        partitions = [tp for tp in assignment if tp.topic == topic]
        marks = {(tp.topic, tp.partition): (consumer.highwater(tp), None) for tp in partitions}
        topic_progress.update(marks)
        for topic_name, partition in topic_progress.unplaced():
            tp = next(tp for tp in partitions if tp.partition == partition)
            position = await asyncio.wait_for(consumer.position(tp), QUERY_TIMEOUT_S)
            marks[(topic_name, partition)] = (marks[(topic_name, partition)][0], position)
        topic_progress.update(marks)
        stale = set(topic_progress.stale())
        if stale:
            asked = await asyncio.wait_for(
                consumer.highwaters(*(tp for tp in partitions if tp in stale)),
                QUERY_TIMEOUT_S,
            )
            topic_progress.queried({(tp.topic, tp.partition): high for tp, high in asked.items()})
