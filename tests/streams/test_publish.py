"""The publisher against a fake Kafka: records that do not fit their topic, record
batches Kafka refuses (split until the record at fault is found), retries that send
only what was not acknowledged, and order per key through all of it."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import zlib
from collections.abc import Callable

import pytest
from confluent_kafka import KafkaError, KafkaException

from streams.config import BrokerConfig
from streams.errors import PublishError
from streams.outgoing import KEPT_BYTES, REDELIVERED, Outgoing, mark_redelivered, wire_bytes
from streams.publish import Publisher
from streams.records import InputRecord, Item, OutRecord

PARTITIONS = 3


class FakeKafka:
    """A broker with topic size limits and its producers. A producer queues what it is
    given; `poll` sends the queue as record batches per partition (up to `batch.size`)
    and reports each record. A batch larger than its topic's limit is refused, and, as
    librdkafka does with `enable.gapless.guarantee`, the producer then stops: whatever
    it still holds fails (purged) and it produces no more."""

    def __init__(self, limits: dict[str, int]) -> None:
        self.limits = limits
        self.written: dict[tuple[str, int], list[OutRecord]] = {}
        self.producers: list[FakeProducer] = []
        self.fail: Callable[[OutRecord], int | None] = lambda record: None
        """A record batch holding a record this returns a code for fails with that code."""

    def make_producer(self, config: dict) -> FakeProducer:
        producer = FakeProducer(self, config)
        self.producers.append(producer)
        return producer

    def records(self, topic: str) -> list[OutRecord]:
        return [r for (t, _p), records in sorted(self.written.items()) if t == topic
                for r in records]  # fmt: skip


def partition_of(key: bytes | None) -> int:
    return zlib.crc32(key or b"") % PARTITIONS


class FakeProducer:
    def __init__(self, kafka: FakeKafka, config: dict) -> None:
        self.kafka = kafka
        self.config = config
        self.stopped = False
        self.batch_calls = 0
        self._queue: list[tuple[OutRecord, Callable]] = []
        self._changed = threading.Condition()

    def produce(self, topic, value, key, headers, on_delivery) -> None:
        if self.stopped:
            raise KafkaException(KafkaError(KafkaError._FATAL))
        record = OutRecord(topic, key, value, list(headers))
        if wire_bytes(record) > self.config["message.max.bytes"]:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        with self._changed:
            self._queue.append((record, on_delivery))
            self._changed.notify_all()

    def produce_batch(self, topic, messages) -> int:
        """librdkafka's batch call: each message queued, or marked with its `_error`."""
        self.batch_calls += 1
        queued = 0
        for message in messages:
            try:
                self.produce(topic, message["value"], message["key"], [], message["callback"])
                queued += 1
            except KafkaException as exc:
                message["_error"] = exc.args[0]
        return queued

    def __len__(self) -> int:
        return len(self._queue)

    def flush(self, timeout_s: float) -> int:
        while self._queue:
            self.poll(0)
        return 0

    def poll(self, timeout_s: float) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self._queue, timeout_s)
            queue, self._queue = self._queue, []
        by_partition: dict[tuple[str, int], list] = {}
        for record, report in queue:
            by_partition.setdefault((record.topic, partition_of(record.key)), []).append(
                (record, report)
            )
        for where, records in by_partition.items():
            for batch in self._batches(records):
                self._send(where, batch)
        if self.stopped and queue:
            raise KafkaException(KafkaError(KafkaError._GAPLESS_GUARANTEE, fatal=True))
        return len(queue)

    def _batches(self, records: list) -> list[list]:
        batches, size = [[]], 0
        for record, report in records:
            bytes_ = wire_bytes(record)
            if batches[-1] and size + bytes_ > self.config["batch.size"]:
                batches.append([])
                size = 0
            batches[-1].append((record, report))
            size += bytes_
        return batches

    def _send(self, where: tuple[str, int], batch: list) -> None:
        if self.stopped:
            for _record, report in batch:
                report(KafkaError(KafkaError._PURGE_QUEUE), None)
            return
        failing = [code for record, _ in batch if (code := self.kafka.fail(record)) is not None]
        size = sum(wire_bytes(record) for record, _ in batch)
        if failing:
            code = failing[0]
            self.stopped = code == KafkaError.INVALID_RECORD  # refused: gapless stops too
        elif size > self.kafka.limits[where[0]]:
            code = KafkaError.MSG_SIZE_TOO_LARGE
            self.stopped = True  # gapless: nothing after a refused batch is written
        else:
            self.kafka.written.setdefault(where, []).extend(record for record, _ in batch)
            for _record, report in batch:
                report(None, None)
            return
        for _record, report in batch:
            report(KafkaError(code), None)


def source(offset: int, value: bytes = b"v", key: bytes = b"k") -> InputRecord:
    return InputRecord("in", 0, offset, 0, key, value)


def answer(offset: int, size: int = 100, key: bytes = b"k") -> OutRecord:
    return OutRecord("out", key, offset.to_bytes(4, "big") + b"a" * (size - 4))


def letter(offset: int, value: bytes, key: bytes = b"k") -> OutRecord:
    headers = [("headrace.error.reason", b"bad_magic"),
               ("headrace.error.message", b"expected magic byte 0, got 255"),
               ("headrace.input.offset", str(offset).encode())]  # fmt: skip
    return OutRecord("dlq", key, value, headers)


def item(record: InputRecord, redelivered: bool = False) -> Item:
    return Item(record, record.offset, deadline_s=0.0, redelivered=redelivered)


def outgoing(records: list[OutRecord], inputs: list[InputRecord] | None = None) -> Outgoing:
    inputs = inputs or [source(i) for i in range(len(records))]
    return Outgoing(records, inputs, "fraud", "dlq")


def publisher(kafka: FakeKafka, believed: dict[str, int] | None = None) -> Publisher:
    """A started publisher that believes the topics' limits are `believed` (default:
    what they are)."""
    limits = believed or kafka.limits
    built = Publisher(BrokerConfig(), ["out", "dlq"], make_producer=kafka.make_producer,
                      read_limits=lambda topics: {t: limits[t] for t in topics})  # fmt: skip
    built.start()
    return built


def publish(built: Publisher, *batches: Outgoing) -> None:
    async def run() -> None:
        await asyncio.gather(*(built.publish(batch) for batch in batches))

    asyncio.run(asyncio.wait_for(run(), 30))


def headers(record: OutRecord) -> dict[str, str]:
    return {name: value.decode() for name, value in record.headers}


def test_the_producer_is_sized_by_the_topics_it_writes():
    kafka = FakeKafka({"out": 2_000_000, "dlq": 1_048_588})
    built = publisher(kafka)
    (config,) = [p.config for p in kafka.producers]
    assert config["message.max.bytes"] == 2_000_000
    assert config["batch.size"] == 1_000_000  # librdkafka's default, below both limits
    assert config["enable.gapless.guarantee"] is True
    built.stop()
    fixed = Publisher(
        BrokerConfig(max_message_bytes=500_000), ["out", "dlq"],
        make_producer=kafka.make_producer, read_limits=lambda topics: pytest.fail("read"),
    )  # fmt: skip
    assert fixed.limits == {"out": 500_000, "dlq": 500_000}
    assert kafka.producers[-1].config["batch.size"] == 500_000


def test_topic_limits_that_cannot_be_read_fall_back_to_librdkafkas_default():
    def unreadable(topics):
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    kafka = FakeKafka({"out": 1_048_588, "dlq": 1_048_588})
    built = Publisher(BrokerConfig(), ["out", "dlq"], make_producer=kafka.make_producer,
                      read_limits=unreadable)  # fmt: skip
    assert built.limits == {"out": 1_000_000, "dlq": 1_000_000}


def test_a_dead_letter_too_large_for_its_topic_is_written_cut_with_its_size_and_hash():
    kafka = FakeKafka({"out": 100_000, "dlq": 5_000})
    built = publisher(kafka)
    big = b"\xff" * 50_000
    batch = outgoing([answer(0), answer(1), letter(2, big), answer(3)],
                     [source(0), source(1), source(2, big), source(3)])  # fmt: skip
    publish(built, batch)
    built.stop()
    assert [r.value[:4] for r in kafka.records("out")] == [answer(i).value[:4] for i in (0, 1, 3)]
    (cut,) = kafka.records("dlq")
    found = headers(cut)
    assert found["headrace.error.reason"] == "too_large"
    assert found["headrace.error.cause"] == "bad_magic"
    assert found["headrace.value.size"] == "50000"
    assert found["headrace.value.sha256"] == hashlib.sha256(big).hexdigest()
    assert found["headrace.input.offset"] == "2"
    assert "expected magic byte 0" in found["headrace.error.message"]
    assert cut.value == big[:KEPT_BYTES] and cut.key == b"k"
    assert batch.rewritten == {2: "too_large"}
    assert all(batch.delivered)
    assert len(kafka.producers) == 1  # found before sending: nothing was refused


def test_an_answer_too_large_for_its_topic_dead_letters_its_input_keeping_its_marker():
    kafka = FakeKafka({"out": 10_000, "dlq": 100_000})
    built = publisher(kafka)
    inputs = [source(0), source(1, b"the input"), source(2)]
    records = [answer(0), answer(1, size=20_000), answer(2)]
    # The two last inputs were read again after a handover the check could not see.
    mark_redelivered([item(r, redelivered=i > 0) for i, r in enumerate(inputs)], records)
    batch = outgoing(records, inputs)
    publish(built, batch)
    built.stop()
    assert [headers(r).get(REDELIVERED) for r in kafka.records("out")] == [None, "1"]
    (letter_,) = kafka.records("dlq")
    assert letter_.value == b"the input"  # it fits: whole
    assert headers(letter_)["headrace.error.reason"] == "too_large"
    assert "its answer cannot be written" in headers(letter_)["headrace.error.message"]
    assert headers(letter_)[REDELIVERED] == "1"  # kept by the smaller form
    assert batch.rewritten == {1: "too_large"}


def test_a_dead_letter_marked_redelivered_on_a_retry_keeps_the_marker_when_cut():
    inputs = [source(0, b"x" * 5_000)]
    batch = outgoing([answer(0)], inputs)
    batch.reduce(0, "too_large", "out refused its 100 bytes")  # the input's dead letter
    # A retry after a handover the check could not see marks what it sends again.
    mark_redelivered([item(inputs[0], redelivered=True)], batch.records)
    cut = batch.reduce(0, "too_large", "dlq refused its 5,200 bytes")
    assert headers(cut)[REDELIVERED] == "1"
    assert cut.value == b"x" * KEPT_BYTES


def test_a_record_batch_kafka_refuses_is_split_until_the_record_at_fault_is_found():
    # The publisher believes the output topic takes 100 kB; it takes 3 kB (lowered
    # while the worker runs): the refused batch stops the producer (gapless).
    kafka = FakeKafka({"out": 3_000, "dlq": 100_000})
    built = publisher(kafka, believed={"out": 100_000, "dlq": 100_000})
    records = [answer(i, size=5_000 if i == 5 else 200) for i in range(12)]
    batch = outgoing(records)
    publish(built, batch)
    built.stop()
    written = kafka.records("out")
    # Each other answer written once, in order; the one at fault dead-lettered.
    assert [r.value[:4] for r in written] == [records[i].value[:4] for i in range(12) if i != 5]
    (letter_,) = kafka.records("dlq")
    assert headers(letter_)["headrace.input.offset"] == "5"
    assert headers(letter_)["headrace.error.reason"] == "too_large"
    assert batch.rewritten == {5: "too_large"}
    assert len(kafka.producers) >= 2  # a stopped producer is replaced


def test_a_record_refused_for_what_it_is_is_dead_lettered_as_unpublishable():
    kafka = FakeKafka({"out": 100_000, "dlq": 100_000})
    built = publisher(kafka)
    refused = answer(3)
    kafka.fail = lambda r: KafkaError.INVALID_RECORD if r == refused else None
    batch = outgoing([answer(i) for i in range(3)] + [refused] + [answer(4)])
    publish(built, batch)
    built.stop()
    assert len(kafka.records("out")) == 4
    (letter_,) = kafka.records("dlq")
    assert headers(letter_)["headrace.error.reason"] == "unpublishable"
    assert "out refused its" in headers(letter_)["headrace.error.message"]
    assert batch.rewritten == {3: "unpublishable"}


def test_a_retry_sends_only_what_kafka_did_not_acknowledge():
    kafka = FakeKafka({"out": 100_000, "dlq": 100_000})
    built = publisher(kafka)
    # Two keys on two partitions; the second one's partition is away for a while.
    first, second = b"a", b"b"
    assert partition_of(first) != partition_of(second)
    records = [answer(i, key=first if i < 4 else second) for i in range(8)]
    batch = outgoing(records)
    away = threading.Event()
    away.set()
    kafka.fail = lambda r: KafkaError._MSG_TIMED_OUT if away.is_set() and r.key == second else None
    with pytest.raises(PublishError, match="4 of 8 records were not delivered"):
        publish(built, batch)
    assert batch.delivered == [True] * 4 + [False] * 4
    away.clear()
    publish(built, batch)  # the runner's retry
    built.stop()
    values = [r.value[:4] for r in kafka.records("out")]
    assert sorted(values) == sorted(r.value[:4] for r in records)  # each exactly once
    assert len(values) == len(set(values)) == 8


def test_batches_stopped_by_another_batchs_refusal_are_written_once_in_order():
    kafka = FakeKafka({"out": 3_000, "dlq": 100_000})
    built = publisher(kafka, believed={"out": 100_000, "dlq": 100_000})
    guilty = outgoing([answer(i, size=5_000 if i == 2 else 200) for i in range(6)])
    others = [outgoing([answer(100 + 10 * b + i, key=b"x") for i in range(5)]) for b in range(3)]
    publish(built, guilty, *others)
    built.stop()
    by_key = {key: [r.value[:4] for r in kafka.records("out") if r.key == key]
              for key in (b"k", b"x")}  # fmt: skip
    assert by_key[b"k"] == [answer(i).value[:4] for i in (0, 1, 3, 4, 5)]
    # The other batches ran concurrently: each record once, and in order within a batch.
    offsets = [int.from_bytes(v, "big") for v in by_key[b"x"]]
    assert sorted(offsets) == [100 + 10 * b + i for b in range(3) for i in range(5)]
    for b in range(3):
        mine = [o for o in offsets if 100 + 10 * b <= o < 110 + 10 * b]
        assert mine == sorted(mine)


def test_a_dead_letter_topic_that_takes_nothing_is_a_publish_error():
    kafka = FakeKafka({"out": 10_000, "dlq": 600})  # less than a dead letter's headers
    built = publisher(kafka)
    batch = outgoing([answer(0), letter(1, b"\xff" * 5_000)], [source(0), source(1, b"x" * 5_000)])
    with pytest.raises(PublishError, match="even its dead letter without key or value"):
        publish(built, batch)
    built.stop()
    assert batch.delivered[0] and not batch.delivered[1]


def test_kafka_that_stays_unwritable_is_a_publish_error_and_nothing_is_repeated():
    kafka = FakeKafka({"out": 100_000, "dlq": 100_000})
    built = publisher(kafka)
    kafka.fail = lambda r: KafkaError._MSG_TIMED_OUT
    batch = outgoing([answer(i) for i in range(3)])
    for _attempt in range(3):
        with pytest.raises(PublishError, match="3 of 3 records were not delivered"):
            publish(built, batch)
    built.stop()
    assert kafka.records("out") == [] and len(kafka.producers) == 1


def test_a_warm_up_the_broker_does_not_answer_is_logged_not_raised(caplog):
    kafka = FakeKafka({"out": 1_048_588, "dlq": 1_048_588})
    built = publisher(kafka)
    asked: list[tuple[str, float]] = []

    def unanswered(topic: str, timeout: float) -> None:
        asked.append((topic, timeout))
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    kafka.producers[0].list_topics = unanswered
    built.warm(0.5)
    built.stop()
    # Only the topics it writes, within the warm-up's time; the first failure ends it.
    assert [topic for topic, _ in asked] == ["dlq"]
    assert 0 < asked[0][1] <= 0.5
    assert "could not read the topics' metadata" in caplog.text


def test_a_batchs_plain_answers_are_handed_over_together_and_in_order():
    kafka = FakeKafka({"out": 100_000, "dlq": 100_000})
    built = publisher(kafka)
    records = [answer(i) for i in range(4)] + [letter(4, b"x")] + [answer(i) for i in (5, 6, 7)]
    publish(built, outgoing(records))
    built.stop()
    # Two runs of answers in one call each; the dead letter (headers) on its own.
    assert kafka.producers[0].batch_calls == 2
    assert [r.value[:4] for r in kafka.records("out")] == [
        answer(i).value[:4] for i in (0, 1, 2, 3, 5, 6, 7)
    ]
    assert len(kafka.records("dlq")) == 1
