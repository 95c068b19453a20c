"""Answered before: inputs past a partition's committed offset that already have an
outcome, so that a worker taking the partition over does not answer them again.

A worker that dies (kill -9, out of memory) after writing answers but before committing
their offsets leaves inputs its partitions' next owner reads again: answered twice, and
the second answer may contradict the first (past its deadline by then, it is shed). So
before answering a newly assigned partition, a worker reads its pipeline's outcome
topics (answers and dead letters) from shortly before the first uncommitted input was
written up to their current end, and collects the inputs of that partition the outcomes
name past its committed offset. Those are acknowledged without a second answer.

Bounded on purpose: outcomes are read back at most `lookback_s` (older answers of an
input past the committed offset mean the group was down longer than that: they are
answered again, as at-least-once allows), records are timed by clocks that may differ
(`CLOCK_SKEW_S` of margin), and a check that fails (the broker, the registry) or takes
longer than `CHECK_TIMEOUT_S` is logged and skipped: at worst an input is answered
twice, never lost. An answer written by the previous owner after the check (a clean
rebalance whose drain outlasts it) is not seen either. With exactly-once delivery the
transactions already guarantee all of this and nothing is read.

Where the check cannot see (it failed or timed out, its lookback did not reach back to
a partition's first uncommitted input, or `lookback_s` is 0), the inputs between the
committed offset and the end of the partition at assignment are answered again with a
`headrace.redelivered` header: a consumer that must never see a repeat only needs to
look up the marked answers (the first answer wins). A partition the group never
committed is not marked: nothing was handed over. Where it finds inputs answered past
the committed offset, the previous owner stopped without handing the partition over:
killed, or frozen past its session, and then it may still answer the records it held
once it runs again, after this check read the topics. The rest of that partition's
inputs up to its end at the assignment are marked as well, so the frozen worker's late
answer (marked too, `streams/freeze.py`) and this worker's, in either order, leave a
reader that keeps the first answer per input no unmarked repeat.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Message
from confluent_kafka import TopicPartition as KafkaPartition

from infra.kafka_clients import RANGE_READER_SETTINGS, read_range
from schemas.codec import AvroDecoder
from schemas.errors import DecodeError, RegistryError

log = logging.getLogger(__name__)

Partition = tuple[str, int]
"""(topic, partition) of an input."""

CLOCK_SKEW_S = 10.0
CHECK_TIMEOUT_S = 10.0
_REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Replay:
    """What the check at an assignment found for one partition."""

    answered: frozenset[int] = frozenset()
    """Offsets past the committed one already answered: acknowledged, not answered again."""
    unchecked: range = range(0)
    """Offsets past the committed one the check cannot vouch for (it could not see their
    earlier answers, or a previous owner that did not hand over may still answer them):
    answered again, marked `headrace.redelivered` (except those in `answered`)."""

    @property
    def end(self) -> int:
        """The first offset the check says nothing about."""
        return max(self.unchecked.stop, max(self.answered, default=-1) + 1)


@dataclass(frozen=True)
class OutcomeTopics:
    """Where one input topic's outcomes go."""

    output_topic: str
    dead_letter_topic: str


def input_of_answer(message: Message, decoder: AvroDecoder) -> tuple[str, int, int] | None:
    """The input (topic, partition, offset) an answer names; None when unreadable."""
    try:
        answer = decoder.decode(message.value())
    except DecodeError:
        return None
    return input_named(answer)


def input_named(answer: Any) -> tuple[str, int, int] | None:
    """The input a decoded answer names; None for a record that is no headrace answer
    (another producer's, in a topic it shares)."""
    if not isinstance(answer, dict):
        return None
    topic = answer.get("input_topic")
    partition, offset = answer.get("input_partition"), answer.get("input_offset")
    if isinstance(topic, str) and isinstance(partition, int) and isinstance(offset, int):
        return topic, partition, offset
    return None


def input_of_dead_letter(message: Message) -> tuple[str, int, int] | None:
    """The input a dead letter names in its headers; None when it names none (or names
    it in a form no headrace worker writes)."""
    headers = dict(message.headers() or [])
    try:
        return (
            headers["headrace.input.topic"].decode(),
            int(headers["headrace.input.partition"]),
            int(headers["headrace.input.offset"]),
        )
    except (KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError):
        return None


class AnsweredBefore:
    """Reads the outcome topics back for newly assigned input partitions (blocking)."""

    def __init__(
        self,
        settings: Mapping[str, object],
        group: str,
        outcomes: Mapping[str, OutcomeTopics],
        decoder: AvroDecoder,
        lookback_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = {
            **settings,
            "group.id": group,
            **RANGE_READER_SETTINGS,
        }
        self._outcomes = outcomes
        self._decoder = decoder
        self._lookback_s = lookback_s
        self._clock = clock

    def scan(self, partitions: Iterable[Partition]) -> dict[Partition, Replay]:
        """Per partition checked, what was answered past its committed offset, and what
        could not be checked (empty ones included: what a caller remembered for it is out
        of date). {} when not even the committed offsets could be read."""
        wanted = [p for p in partitions if p[0] in self._outcomes]
        if not wanted:
            return {}
        started = time.monotonic()
        consumer = Consumer(self._settings)
        try:
            return self._check(consumer, wanted, started)
        finally:
            consumer.close()

    def _check(
        self, consumer: Consumer, wanted: list[Partition], started: float
    ) -> dict[Partition, Replay]:
        deadline = started + CHECK_TIMEOUT_S  # the whole check's, its first calls too
        try:
            windows, handed_over = self._uncommitted(consumer, wanted, deadline)
        except (KafkaException, TimeoutError) as exc:
            log.warning(
                "could not read the committed offsets of %d newly assigned partitions "
                "(%s); inputs answered before a crash may be answered again, unmarked",
                len(wanted), exc,
            )  # fmt: skip
            return {}
        checked = dict.fromkeys(wanted, Replay())
        unchecked = {p: Replay(unchecked=windows[p]) for p in handed_over}
        if self._lookback_s <= 0 or not windows:  # nothing to read back: mark them
            return {**checked, **unchecked}
        try:
            found, reached = self._scan(consumer, windows, deadline)
        except (KafkaException, RegistryError, TimeoutError) as exc:
            log.warning(
                "could not read back the answers of %d newly assigned partitions (%s); "
                "the %d inputs past their committed offsets are answered again, marked "
                "headrace.redelivered", len(wanted), exc,
                sum(len(replay.unchecked) for replay in unchecked.values()),
            )  # fmt: skip
            return {**checked, **unchecked}
        for partition, offsets in found.items():
            unseen = partition in handed_over and partition not in reached
            # Answers past the commit: the previous owner did not hand the partition over
            # cleanly. Dead, or frozen and still running: what it answers next lands after
            # this read, so the rest of the window is marked too.
            window = windows[partition] if unseen or offsets else range(0)
            checked[partition] = Replay(frozenset(offsets), window)
        repeats = sum(len(offsets) for offsets in found.values())
        if repeats:
            marked = sum(len(windows[p]) - len(o) for p, o in found.items() if o)
            log.warning(
                "%d inputs past the committed offsets of %s were answered before (by a "
                "worker that stopped before committing): not answered again; the %d "
                "others of those partitions up to their end are answered marked "
                "headrace.redelivered, in case that worker still answers them (checked "
                "in %.2f s)", repeats,
                ", ".join(f"{t}[{p}]" for (t, p), o in found.items() if o), marked,
                time.monotonic() - started,
            )  # fmt: skip
        return checked

    def _scan(
        self, consumer: Consumer, windows: dict[Partition, range], deadline: float
    ) -> tuple[dict[Partition, set[int]], set[Partition]]:
        """The answered offsets found per partition, and the partitions whose every
        uncommitted input the read reached back to (the lookback bounds it)."""
        first_ms = self._first_timestamps_ms(consumer, windows, deadline)
        windows = {p: window for p, window in windows.items() if p in first_ms}
        if not windows:
            return {}, set()
        since_ms = max(
            min(first_ms.values()) - CLOCK_SKEW_S * 1000,
            (self._clock() - self._lookback_s) * 1000,
        )
        reached = {p for p, stamp in first_ms.items() if stamp - CLOCK_SKEW_S * 1000 >= since_ms}
        found: dict[Partition, set[int]] = {p: set() for p in windows}

        def keep(named: tuple[str, int, int] | None) -> None:
            if named is not None:
                topic, partition, offset = named
                window = windows.get((topic, partition))
                if window is not None and offset >= window.start:
                    found[(topic, partition)].add(offset)

        topics = {self._outcomes[topic] for topic, _ in windows}
        for outcome in topics:
            _read_since(consumer, outcome.output_topic, since_ms, deadline,
                        lambda m: keep(input_of_answer(m, self._decoder)))  # fmt: skip
            _read_since(consumer, outcome.dead_letter_topic, since_ms, deadline,
                        lambda m: keep(input_of_dead_letter(m)))  # fmt: skip
        return found, reached

    @staticmethod
    def _uncommitted(
        consumer: Consumer, wanted: list[Partition], deadline: float
    ) -> tuple[dict[Partition, range], set[Partition]]:
        """The inputs past the committed offset of each partition that has some (from the
        log start where the group never committed), and which of those partitions the
        group did commit (handed over: a previous owner may have answered them)."""
        asked = [KafkaPartition(topic, partition) for topic, partition in wanted]
        windows, handed_over = {}, set()
        for tp in consumer.committed(asked, timeout=_left(deadline)):
            low, high = consumer.get_watermark_offsets(tp, timeout=_left(deadline))
            start = low if tp.offset == OFFSET_INVALID else max(tp.offset, low)
            if start < high:
                windows[(tp.topic, tp.partition)] = range(start, high)
                if tp.offset != OFFSET_INVALID:
                    handed_over.add((tp.topic, tp.partition))
        return windows, handed_over

    @staticmethod
    def _first_timestamps_ms(
        consumer: Consumer, windows: dict[Partition, range], deadline: float
    ) -> dict[Partition, int]:
        """The Kafka timestamp of each partition's first uncommitted input; none for a
        partition whose window holds no record to read: a topic written in transactions
        has a marker after its last input (the committed offset points at it), and an
        upstream transaction still open is not readable yet (nor was it to anyone)."""
        starts = {partition: window.start for partition, window in windows.items()}
        consumer.assign([KafkaPartition(t, p, offset) for (t, p), offset in starts.items()])
        stamps: dict[Partition, int] = {}
        ended: set[Partition] = set()
        while len(stamps) + len(ended) < len(starts):
            if time.monotonic() > deadline:
                raise TimeoutError("the first uncommitted inputs were not read in time")
            for message in consumer.consume(len(starts), 0.2):
                where, error = (message.topic(), message.partition()), message.error()
                if where in stamps:
                    continue
                if error is None:
                    stamps[where] = message.timestamp()[1]
                    ended.discard(where)
                elif error.code() == KafkaError._PARTITION_EOF:
                    ended.add(where)
        consumer.unassign()
        return stamps


def _left(deadline: float) -> float:
    """The timeout of one broker request of a check that must end by `deadline`: one
    request per partition at a full 5 s each blocked the bare poll thread for a minute."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the read-back ran out of time")
    return min(_REQUEST_TIMEOUT_S, left)


def _read_since(
    consumer: Consumer,
    topic: str,
    since_ms: float,
    deadline: float,
    handle: Callable[[Message], None],
) -> None:
    """Hand every record of `topic` written since `since_ms`, up to the current end."""
    metadata = consumer.list_topics(topic, timeout=_left(deadline)).topics.get(topic)
    if metadata is None or metadata.error is not None:
        return  # not created yet: nothing was written to it
    asked = [KafkaPartition(topic, p, int(since_ms)) for p in metadata.partitions]
    starts, stops = {}, {}
    for tp in consumer.offsets_for_times(asked, timeout=_left(deadline)):
        high = consumer.get_watermark_offsets(tp, timeout=_left(deadline))[1]
        if 0 <= tp.offset < high:  # -1: nothing written since then
            starts[tp.partition], stops[tp.partition] = tp.offset, high
    read_range(consumer, topic, starts, stops, handle, deadline)
