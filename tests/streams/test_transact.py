"""The transactional publisher (`delivery: exactly_once`) against a real broker: a
batch's records and its input offsets commit together; a newer producer with the same
transactional id fences the older; offsets sent for a member the group no longer has
are refused and the batch is written again with the current metadata, once as a
read_committed reader sees it; a record Kafka refuses inside a transaction is found
and dead-lettered; and how librdkafka's group metadata tells a member."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from prometheus_client import REGISTRY

from infra.topics import delete_topics
from streams import transact
from streams.config import BrokerConfig
from streams.consumers import faust_transactions
from streams.consumers.faust_transactions import StableOffsets, UnstableOffsets, released
from streams.errors import TransactionFailed, TransactionFenced
from streams.outgoing import Outgoing
from streams.publish import topic_limits
from streams.records import InputRecord, OutRecord
from streams.transact import TransactionalPublisher, group_metadata, is_member, next_offsets
from tests.chaos.conftest import create_topics
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def topics(kafka) -> Iterator[dict[str, str]]:
    """An input topic (3 partitions), an output topic (3, compacted: a keyless record is
    refused, and a record batch over 4,000 bytes) and a dead-letter topic (1)."""
    suffix = uuid.uuid4().hex[:8]
    names = {"in": f"in-{suffix}", "out": f"out-{suffix}", "dlq": f"dlq-{suffix}"}
    create_topics(
        kafka.bootstrap_servers,
        {
            names["in"]: (3, {}),
            names["out"]: (3, {"cleanup.policy": "compact", "max.message.bytes": "4000"}),
            names["dlq"]: (1, {}),
        },
    )
    yield names
    delete_topics(kafka.bootstrap_servers, list(names.values()))


@pytest.fixture
def member(kafka) -> Iterator:
    """Factory: `member(group, topic, instance_id=None)`, a consumer of `group` with
    `topic`'s partitions assigned (a member of a generation); closed at the end unless
    closed before."""
    made: list[Consumer] = []

    def join(group: str, topic: str, instance_id: str | None = None) -> Consumer:
        assigned = []
        settings = {"bootstrap.servers": kafka.bootstrap_servers, "group.id": group}
        if instance_id is not None:
            settings["group.instance.id"] = instance_id
        consumer = Consumer(settings)
        made.append(consumer)
        consumer.subscribe([topic], on_assign=lambda _c, partitions: assigned.extend(partitions))
        deadline = time.monotonic() + 60
        while not assigned:
            assert time.monotonic() < deadline, "no assignment"
            consumer.poll(0.1)
        return consumer

    yield join
    for consumer in made:
        with contextlib.suppress(RuntimeError):  # closed already
            consumer.close()


def metadata_of(*consumers: Consumer):
    """A group metadata reader answering with each consumer's in turn, the last for good;
    it counts its calls."""
    calls = []

    async def read() -> bytes:
        calls.append(1)
        return consumers[min(len(calls), len(consumers)) - 1].consumer_group_metadata()

    read.calls = calls
    return read


def transactional(bootstrap: str, topics: dict[str, str], tid: str, **kwargs):
    built = TransactionalPublisher(
        BrokerConfig(bootstrap_servers=bootstrap), [topics["out"], topics["dlq"]],
        transactional_id=tid, **kwargs,
    )  # fmt: skip
    built.start()
    return built


def batch(topics: dict[str, str], values: list[bytes | None], first_offset: int = 0) -> Outgoing:
    """One answer per value (key `k<i>`, or none where the value is None), each answering
    input `first_offset + i` of partition i % 3."""
    records, inputs = [], []
    for i, value in enumerate(values):
        key = None if value is None else f"k{i}".encode()
        records.append(OutRecord(topics["out"], key, value or b"no key"))
        inputs.append(InputRecord(topics["in"], i % 3, first_offset + i, 0, key, b"input"))
    return Outgoing(records, inputs, "fraud", topics["dlq"])


def publish(built: TransactionalPublisher, outgoing: Outgoing, timeout_s: float = 60) -> None:
    asyncio.run(asyncio.wait_for(built.publish(outgoing), timeout_s))


def publish_at_once(built: TransactionalPublisher, consumer: Consumer, batches: list) -> None:
    """Hand every batch over at once (the first leads a transaction alone; the others
    are handed over while it commits), then stop the publisher."""

    async def at_once() -> None:
        await asyncio.gather(*(built.publish(each) for each in batches))

    try:
        built.attach(metadata_of(consumer))
        asyncio.run(asyncio.wait_for(at_once(), 60))
    finally:
        built.stop()


def read(bootstrap: str, topic: str, isolation_level: str) -> list[Message]:
    """Every record of `topic`, read to the end each partition has now."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"read-{uuid.uuid4().hex[:8]}",
            "enable.partition.eof": True,
            "isolation.level": isolation_level,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), 30)[1] for p in partitions
        }
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        pending = {p for p, end in ends.items() if end > 0}
        records: list[Message] = []
        deadline = time.monotonic() + 60
        while pending:
            assert time.monotonic() < deadline, f"{topic} not read to its end"
            for message in consumer.consume(100, 0.5):
                error = message.error()
                if error is None:
                    records.append(message)
                elif (error.code() == KafkaError._PARTITION_EOF
                      and message.offset() >= ends[message.partition()]):  # fmt: skip
                    pending.discard(message.partition())
        return records
    finally:
        consumer.close()


def committed(consumer: Consumer, topic: str) -> dict[int, int]:
    wanted = [TopicPartition(topic, p) for p in range(3)]
    return {tp.partition: tp.offset for tp in consumer.committed(wanted, timeout=30)}


def test_a_batch_and_its_input_offsets_commit_in_one_transaction(kafka, topics, member):
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}")
    try:
        built.attach(metadata_of(consumer))
        publish(built, batch(topics, [b"a", b"b", b"c", b"d", b"e", b"f"]))
        publish(built, batch(topics, [b"g", b"h", b"i"], first_offset=6))
    finally:
        built.stop()
    values = sorted(m.value() for m in read(bootstrap, topics["out"], "read_committed"))
    assert values == [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h", b"i"]
    # The next offset of each input partition of the last batch: 6, 7, 8 -> 7, 8, 9.
    assert committed(consumer, topics["in"]) == {0: 7, 1: 8, 2: 9}


def test_answers_to_inputs_of_partitions_given_up_are_left_out_until_taken_back(
    kafka, topics, member
):
    """The group took partitions away before their answers were committed: those
    answers and their offsets stay out of every transaction (they count as written),
    and go in again once the partitions are taken back."""
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}")
    everything = [(topics["in"], partition) for partition in range(3)]
    left_out_before = left_out()
    try:
        built.attach(metadata_of(consumer))
        built.give_up([(topics["in"], 1)])
        # Inputs on partitions 0, 1, 2, 0, 1, 2: b and e answer inputs of partition 1.
        first = batch(topics, [b"a", b"b", b"c", b"d", b"e", b"f"])
        publish(built, first)
        assert first.delivered == [True] * 6
        assert committed(consumer, topics["in"]) == {0: 4, 1: OFFSET_INVALID, 2: 6}
        built.give_up(everything)
        publish(built, batch(topics, [b"x", b"y", b"z"], first_offset=6))  # no transaction
        built.take_back(everything)
        publish(built, batch(topics, [b"g", b"h", b"i"], first_offset=9))
    finally:
        built.stop()
    values = sorted(m.value() for m in read(bootstrap, topics["out"], "read_committed"))
    assert values == [b"a", b"c", b"d", b"f", b"g", b"h", b"i"]
    # Left out means never written, not even in a transaction aborted since.
    assert len(read(bootstrap, topics["out"], "read_uncommitted")) == 7
    assert committed(consumer, topics["in"]) == {0: 10, 1: 11, 2: 12}
    assert left_out() - left_out_before == 5  # counted once each, as they were left out


def left_out() -> float:
    return REGISTRY.get_sample_value("headrace_answers_left_out_total", {"pipeline": "fraud"}) or 0


class CountingProducer:
    """A real producer that counts its commits."""

    def __init__(self, config: dict, commits: list) -> None:
        self._producer = Producer(config)
        self._commits = commits

    def commit_transaction(self, *args):
        self._producer.commit_transaction(*args)
        self._commits.append(1)

    def __len__(self) -> int:
        return len(self._producer)

    def __getattr__(self, name):
        return getattr(self._producer, name)


def test_batches_handed_over_while_one_commits_go_together_in_the_next(kafka, topics, member):
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    commits: list[int] = []
    counting = lambda config: CountingProducer(config, commits)  # noqa: E731
    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}", make_producer=counting)
    first, second, third = (batch(topics, [b"%d" % (offset + i) for i in range(3)], offset)
                            for offset in (0, 3, 6))  # fmt: skip
    publish_at_once(built, consumer, [first, second, third])
    # The first alone; the two handed over while it committed, together.
    assert len(commits) == 2
    answers = read(bootstrap, topics["out"], "read_committed")
    assert sorted(m.value() for m in answers) == [b"%d" % i for i in range(9)]
    assert committed(consumer, topics["in"]) == {0: 7, 1: 8, 2: 9}


def test_a_newer_producer_with_the_same_id_fences_the_older(kafka, topics, member):
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    tid = f"t-{uuid.uuid4().hex}"
    older = transactional(bootstrap, topics, tid)
    newer = transactional(bootstrap, topics, tid)  # its initialization fences the older
    try:
        older.attach(metadata_of(consumer))
        newer.attach(metadata_of(consumer))
        with pytest.raises(TransactionFenced, match="took over"):
            publish(older, batch(topics, [b"zombie"]))
        publish(newer, batch(topics, [b"alive"]))
    finally:
        older.stop()
        newer.stop()
    assert [m.value() for m in read(bootstrap, topics["out"], "read_committed")] == [b"alive"]
    assert committed(consumer, topics["in"])[0] == 1


def test_offsets_for_a_member_the_group_no_longer_has_are_refused_and_written_again(
    kafka, topics, member
):
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    gone = member(group, topics["in"])
    stale = gone.consumer_group_metadata()
    gone.close()  # leaves the group: its member id is no longer known
    current = member(group, topics["in"])
    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}")
    given: list[bytes] = []

    async def stale_first() -> bytes:
        given.append(stale if not given else current.consumer_group_metadata())
        return given[-1]

    try:
        built.attach(stale_first)
        publish(built, batch(topics, [b"a", b"b", b"c"]))
    finally:
        built.stop()
    assert given[0] == stale and len(given) == 2, "the stale metadata, then the current"
    # Whatever of the aborted attempt reached the log (all of it, or nothing when the
    # abort came before the producer sent it) is never visible to read_committed.
    assert sorted(m.value() for m in read(bootstrap, topics["out"], "read_committed")) == [
        b"a", b"b", b"c"]  # fmt: skip
    uncommitted = sorted(m.value() for m in read(bootstrap, topics["out"], "read_uncommitted"))
    assert uncommitted in ([b"a", b"b", b"c"], [b"a", b"a", b"b", b"b", b"c", b"c"])
    assert committed(current, topics["in"]) == {0: 1, 1: 2, 2: 3}


@pytest.mark.parametrize("rejoined", [True, False], ids=["own consumer rejoined", "zombie"])
def test_offsets_of_a_static_member_fenced_by_its_own_rejoin_are_written_again(
    kafka, topics, member, rejoined
):
    """With an instance id, a consumer whose session lapsed (a broker outage longer than
    the session) joins again under a new member id, which fences the metadata read
    before: the group moved on, as after a rebalance, and the batch is written again
    (before, the worker took itself for a zombie and ended, exit 70). A member id that
    did not change means another process holds the instance id: TransactionFenced."""
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    before = member(group, topics["in"], instance_id="worker-1")
    stale = before.consumer_group_metadata()
    before.close()  # a static member does not leave: its instance id stays in the group
    again = member(group, topics["in"], instance_id="worker-1")
    assert again.consumer_group_metadata() != stale
    given: list[bytes] = []

    async def membership() -> bytes:
        given.append(again.consumer_group_metadata() if rejoined and given else stale)
        return given[-1]

    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}")
    try:
        built.attach(membership)
        if rejoined:
            publish(built, batch(topics, [b"a", b"b", b"c"]))
        else:
            with pytest.raises(TransactionFenced, match="took over"):
                publish(built, batch(topics, [b"a", b"b", b"c"]))
    finally:
        built.stop()
    answers = sorted(m.value() for m in read(bootstrap, topics["out"], "read_committed"))
    assert answers == ([b"a", b"b", b"c"] if rejoined else [])
    nothing = dict.fromkeys(range(3), OFFSET_INVALID)
    assert committed(again, topics["in"]) == ({0: 1, 1: 2, 2: 3} if rejoined else nothing)


def test_a_publisher_waiting_to_be_a_member_again_holds_no_transaction_open(kafka, topics, member):
    """A worker whose session lapsed waits to rejoin before it can commit. Meanwhile
    read_committed readers of its output topic must go on seeing what others write
    there: an open transaction of its own would hold every later record back."""
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    outside = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    rejoined, waiting = asyncio.Event(), asyncio.Event()
    asked: list[int] = []

    async def membership() -> bytes:
        asked.append(1)
        if len(asked) >= 3:  # asked, and asking again: not a member yet
            waiting.set()
        return (consumer if rejoined.is_set() else outside).consumer_group_metadata()

    async def scenario() -> list[bytes]:
        publishing = asyncio.create_task(built.publish(batch(topics, [b"a", b"b", b"c"])))
        await waiting.wait()
        others = [b"other-%d" % partition for partition in range(3)]
        await asyncio.to_thread(write_plainly, bootstrap, topics["out"], others)
        seen = await asyncio.to_thread(read_committed_until, bootstrap, topics["out"], others)
        rejoined.set()
        await publishing
        return seen

    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}")
    try:
        built.attach(membership)
        seen = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        built.stop()
        outside.close()
    assert sorted(seen) == [b"other-0", b"other-1", b"other-2"]
    answers = sorted(m.value() for m in read(bootstrap, topics["out"], "read_committed"))
    assert answers == [b"a", b"b", b"c", b"other-0", b"other-1", b"other-2"]


class StuckOnceProducer(CountingProducer):
    """A real producer whose first `send_offsets_to_transaction` of all those made never
    returns (until `released`): librdkafka's, once its group coordinator was away."""

    def __init__(self, config: dict, made: list, released: threading.Event) -> None:
        super().__init__(config, [])
        made.append(self)
        self._first = len(made) == 1
        self._released = released

    def send_offsets_to_transaction(self, *args):
        if self._first:
            self._released.wait(60)
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return self._producer.send_offsets_to_transaction(*args)


@pytest.fixture
def short_calls(monkeypatch) -> None:
    """Transactional calls time out after 3 s and are given up on half a second later."""
    monkeypatch.setattr(transact, "CALL_TIMEOUT_S", 3.0)
    monkeypatch.setattr(transact, "STUCK_GRACE_S", 0.5)


def test_a_transactional_call_stuck_past_its_timeout_hands_over_to_a_new_producer(
    kafka, topics, member, short_calls
):
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    made: list[StuckOnceProducer] = []
    released = threading.Event()
    stuck_once = lambda config: StuckOnceProducer(config, made, released)  # noqa: E731
    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}", make_producer=stuck_once)
    try:
        built.attach(metadata_of(consumer))
        publish(built, batch(topics, [b"a", b"b", b"c"]))
    finally:
        released.set()
        built.stop()
    assert len(made) == 2, "the stuck producer was replaced"
    # The successor's initialization aborted the stuck one's transaction.
    answers = sorted(m.value() for m in read(bootstrap, topics["out"], "read_committed"))
    assert answers == [b"a", b"b", b"c"]
    assert committed(consumer, topics["in"]) == {0: 1, 1: 2, 2: 3}


class OutlivedOnceProducer(CountingProducer):
    """A real producer whose first commit of all those made is asked only once Kafka has
    aborted its transaction for outliving `transaction.timeout.ms` (a broker away that
    long): records written plainly after it on every output partition are then visible
    to a read_committed reader."""

    def __init__(self, config: dict, made: list, bootstrap: str, topic: str) -> None:
        super().__init__(config, [])
        made.append(self)
        self._first = len(made) == 1
        self._bootstrap, self._topic = bootstrap, topic

    def commit_transaction(self, *args):
        if self._first:
            self._first = False
            after = [b"after-0", b"after-1", b"after-2"]
            write_plainly(self._bootstrap, self._topic, after)
            bootstrap, topic = self._bootstrap, self._topic

            def visible() -> bool:
                return set(after) <= set(read_committed_until(bootstrap, topic, after, 1.0))

            assert wait_until(visible, 60), "Kafka never aborted the transaction"
        return self._producer.commit_transaction(*args)


def test_a_transaction_kafka_aborted_at_its_timeout_is_written_again_by_a_new_producer(
    kafka, topics, member, monkeypatch
):
    """Kafka aborts a transaction open past its timeout and bumps the producer's epoch,
    which librdkafka reports as a newer instance: that producer can write no more. The
    worker goes on with a new one, which writes the batch again, once."""
    monkeypatch.setattr(transact, "TRANSACTION_TIMEOUT_MS", 2_000)
    monkeypatch.setattr(transact, "TRANSACTION_TIMEOUT_S", 2.0)
    # The commit is asked once Kafka's abort scan (every 10 s) found it.
    monkeypatch.setattr(transact, "CALL_TIMEOUT_S", 60.0)
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    made: list[OutlivedOnceProducer] = []
    outlived_once = lambda config: OutlivedOnceProducer(config, made, bootstrap, topics["out"])  # noqa: E731
    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}", make_producer=outlived_once)
    try:
        built.attach(metadata_of(consumer))
        publish(built, batch(topics, [b"a", b"b", b"c"]), timeout_s=90)
    finally:
        built.stop()
    assert len(made) == 2, "the fenced producer was replaced"
    answers = sorted(m.value() for m in read(bootstrap, topics["out"], "read_committed"))
    assert answers == [b"a", b"after-0", b"after-1", b"after-2", b"b", b"c"]
    assert committed(consumer, topics["in"]) == {0: 1, 1: 2, 2: 3}


class UnknownCommitProducer(CountingProducer):
    """A real producer whose `commit_transaction` never says how it ended: it times out
    (a retriable error), or it never returns (until `released`)."""

    def __init__(self, config: dict, commits: list, stuck: bool, released: threading.Event):
        super().__init__(config, commits)
        self._stuck = stuck
        self._released = released

    def commit_transaction(self, *args):
        self._commits.append(1)
        if self._stuck:
            self._released.wait(60)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, retriable=True))


@pytest.mark.parametrize("stuck", [False, True], ids=["times-out", "never-returns"])
def test_a_commit_whose_outcome_stays_unknown_ends_the_worker_instead_of_writing_again(
    kafka, topics, member, short_calls, stuck
):
    """A commit that may have gone through must not be followed by the same batches in
    another transaction: they would be answered twice."""
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    commits: list[int] = []
    released = threading.Event()
    unknown = lambda config: UnknownCommitProducer(config, commits, stuck, released)  # noqa: E731
    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}", make_producer=unknown)
    try:
        built.attach(metadata_of(consumer))
        with pytest.raises(TransactionFailed, match=r"whether .*committed is unknown"):
            publish(built, batch(topics, [b"a", b"b", b"c"]))
    finally:
        released.set()
        built.stop()  # aborts the transaction left open
    assert len(commits) == (1 if stuck else 3), "asked again while it only timed out"
    assert read(bootstrap, topics["out"], "read_committed") == []


def write_plainly(bootstrap: str, topic: str, values: list[bytes]) -> None:
    """One value per partition, outside any transaction."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for partition, value in enumerate(values):
        producer.produce(topic, value, key=value, partition=partition)
    assert producer.flush(30) == 0


def read_committed_until(
    bootstrap: str, topic: str, wanted: list[bytes], timeout_s: float = 5.0
) -> list[bytes]:
    """What a read_committed reader of `topic` sees within `timeout_s`, or until it has
    seen every value of `wanted`."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed"})  # fmt: skip
    seen: list[bytes] = []
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(3)])
        deadline = time.monotonic() + timeout_s
        while not set(wanted) <= set(seen) and time.monotonic() < deadline:
            seen += [m.value() for m in consumer.consume(100, 0.2) if m.error() is None]
        return seen
    finally:
        consumer.close()


def test_records_kafka_refuses_in_a_transaction_are_found_and_dead_lettered(kafka, topics, member):
    """The output topic takes record batches of up to 4,000 bytes and no keyless record;
    the publisher first believes every topic takes 1 MB. The first transaction is
    refused whole; the limits are read again and the records sent one at a time: the
    long one is dead-lettered before it is sent, the keyless one once it is refused
    alone. The others are written once, in order."""
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    believed = iter([{topics["out"]: 1_000_000, topics["dlq"]: 1_000_000}])

    def read_limits(names):
        return next(believed, None) or topic_limits(bootstrap, names)

    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}", read_limits=read_limits)
    values = [b"s1", b"s2", b"L" * 6_000, b"s3", None, b"s4"]
    outgoing = batch(topics, values)
    try:
        built.attach(metadata_of(consumer))
        publish(built, outgoing)
    finally:
        built.stop()
    answers = read(bootstrap, topics["out"], "read_committed")
    assert sorted(m.value() for m in answers) == [b"s1", b"s2", b"s3", b"s4"]
    letters = read(bootstrap, topics["dlq"], "read_committed")
    reasons = sorted(dict(m.headers())["headrace.error.reason"] for m in letters)
    assert reasons == [b"too_large", b"unpublishable"]
    assert outgoing.rewritten == {2: "too_large", 4: "unpublishable"}
    assert committed(consumer, topics["in"]) == {0: 4, 1: 5, 2: 6}


def test_a_group_refused_whole_is_sent_alone_and_committed_in_chunks(
    kafka, topics, member, monkeypatch
):
    """A pass that sends each record alone costs a round trip a record: over a large
    group it would outlast the transaction timeout (and be fenced), and every record
    found at fault would send the whole group again. So the group is committed a few
    batches at a time, each chunk a transaction of its own."""
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    monkeypatch.setattr(transact, "ALONE_CHUNK_RECORDS", 3)
    commits: list[int] = []
    counting = lambda config: CountingProducer(config, commits)  # noqa: E731
    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}", make_producer=counting)
    values = [[b"0", b"1", b"2"], [b"3", None, b"5"], [b"6", b"7", b"8"], [None, b"10", b"11"]]
    first, *refused = (batch(topics, group_values, 3 * at)
                       for at, group_values in enumerate(values))  # fmt: skip
    publish_at_once(built, consumer, [first, *refused])
    # The first alone; the three handed over while it committed, one chunk each.
    assert len(commits) == 4
    answers = read(bootstrap, topics["out"], "read_committed")
    assert sorted(m.value() for m in answers) == sorted(
        b"%d" % i for i in range(12) if i not in (4, 9)
    )
    letters = read(bootstrap, topics["dlq"], "read_committed")
    assert [dict(m.headers())["headrace.error.reason"] for m in letters] == [b"unpublishable"] * 2
    assert committed(consumer, topics["in"]) == {0: 10, 1: 11, 2: 12}


def test_a_record_whose_smallest_dead_letter_does_not_fit_ends_the_worker_naming_it(
    kafka, topics, member
):
    """The dead-letter topic takes no more than 100 bytes: no form of the long answer's
    dead letter fits. Retrying cannot help; the error says what to fix."""
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topics["in"])
    limits = {topics["out"]: 4_000, topics["dlq"]: 100}
    built = transactional(bootstrap, topics, f"t-{uuid.uuid4().hex}", read_limits=lambda _: limits)
    try:
        built.attach(metadata_of(consumer))
        with pytest.raises(TransactionFailed, match=r"^in-\w+\[1\]@1: even its dead letter"):
            publish(built, batch(topics, [b"s1", b"L" * 6_000]))
    finally:
        built.stop()
    assert read(bootstrap, topics["out"], "read_committed") == []
    assert committed(consumer, topics["in"]) == {
        0: OFFSET_INVALID,
        1: OFFSET_INVALID,
        2: OFFSET_INVALID,
    }


def test_librdkafka_group_metadata_tells_a_member():
    outside = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "g"})
    try:
        metadata = outside.consumer_group_metadata()
    finally:
        outside.close()
    assert not is_member(metadata)  # generation -1, no member id
    generation = (3).to_bytes(4, sys.byteorder)
    assert is_member(b"CGMDv2:" + generation + b"g\0member-1\0\x01")
    assert not is_member(b"CGMDv2:" + generation + b"g\0\0\x01")


@pytest.mark.parametrize("instance_id", [None, "worker-1"])
def test_group_metadata_is_written_as_librdkafka_writes_it(instance_id):
    settings = {"bootstrap.servers": "127.0.0.1:1", "group.id": "g"}
    if instance_id is not None:
        settings["group.instance.id"] = instance_id
    outside = Consumer(settings)
    try:
        theirs = outside.consumer_group_metadata()
    finally:
        outside.close()
    assert group_metadata("g", -1, "", instance_id) == theirs
    assert is_member(group_metadata("g", 4, "member-1", instance_id))


def held_for_a_new_group(kafka, member, topic: str, **settings) -> tuple[Producer, StableOffsets]:
    """A transaction left open that holds offset 5 of `topic`[0] for a new group with one
    member (as a previous owner's would), and a reader of that group's stable offsets."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = member(group, topic)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers,
                         "transactional.id": f"tx-{group}", **settings})  # fmt: skip
    producer.init_transactions(30)
    producer.begin_transaction()
    held = [TopicPartition(topic, 0, 5)]
    producer.send_offsets_to_transaction(held, consumer.consumer_group_metadata(), 30)
    return producer, StableOffsets(group, BrokerConfig(bootstrap_servers=kafka.bootstrap_servers))


def test_stable_offsets_wait_for_the_transaction_that_holds_them(kafka, topics, member):
    """What a new owner reads on the Faust runtime: not the offset from before a
    transaction that still holds the partition's offsets, but what it commits."""
    producer, reader = held_for_a_new_group(kafka, member, topics["in"])
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(reader, [(topics["in"], 0), (topics["in"], 1)])
        with pytest.raises(FutureTimeout):  # the transaction is open: it waits
            reading.result(timeout=1.0)
        producer.commit_transaction(30)
        assert reading.result(timeout=30) == {(topics["in"], 0): 5, (topics["in"], 1): -1}


def test_stable_offsets_name_the_partitions_an_open_transaction_holds_at_once(
    kafka, topics, member
):
    """Which partitions to leave out of a Faust assignment's seek, asked without waiting."""
    producer, reader = held_for_a_new_group(kafka, member, topics["in"])
    both = [(topics["in"], 0), (topics["in"], 1)]
    started = time.monotonic()
    assert reader.held(both) == {(topics["in"], 0)}
    assert time.monotonic() - started < 5  # answered, not waited out
    producer.commit_transaction(30)
    assert wait_until(lambda: not reader.held(both), 30)
    assert reader(both) == {(topics["in"], 0): 5, (topics["in"], 1): -1}


def test_stable_offsets_give_up_on_a_transaction_that_stays_open(
    kafka, topics, member, monkeypatch
):
    """A transaction of the previous owner open past the wait: UnstableOffsets naming the
    partition (on which the Faust runtime ends the worker, exit 70), not an offset."""
    monkeypatch.setattr(faust_transactions, "STABLE_WAIT_S", 1.0)
    # Open past the reader's wait.
    producer, reader = held_for_a_new_group(
        kafka, member, topics["in"], **{"transaction.timeout.ms": 60_000}
    )
    try:
        with pytest.raises(UnstableOffsets, match=rf"{topics['in']}\[0\] within 1 s"):
            reader([(topics["in"], 0)])
    finally:
        producer.abort_transaction(30)


def test_held_partitions_are_released_once_their_transaction_ends(kafka, topics, member):
    """The wait of a Faust assignment's held partitions: over when the transaction
    commits, and not before."""
    producer, reader = held_for_a_new_group(kafka, member, topics["in"])

    async def wait_for_the_commit() -> None:
        waiting = asyncio.ensure_future(released(reader, [(topics["in"], 0), (topics["in"], 1)]))
        done, _ = await asyncio.wait({waiting}, timeout=2.0)
        assert not done  # the transaction is open: it waits
        await asyncio.to_thread(producer.commit_transaction, 30)
        await asyncio.wait_for(waiting, 30)

    try:
        asyncio.run(wait_for_the_commit())
    finally:
        with contextlib.suppress(KafkaException):  # committed already, unless it failed
            producer.abort_transaction(30)
    assert reader([(topics["in"], 0)]) == {(topics["in"], 0): 5}


def test_held_partitions_give_up_naming_those_still_held(kafka, topics, member, monkeypatch):
    """Held past the wait: UnstableOffsets naming the partition the transaction holds
    and no other (on which the Faust runtime ends the worker, exit 70)."""
    monkeypatch.setattr(faust_transactions, "STABLE_WAIT_S", 1.0)
    producer, reader = held_for_a_new_group(
        kafka, member, topics["in"], **{"transaction.timeout.ms": 60_000}
    )
    try:
        with pytest.raises(UnstableOffsets) as raised:
            asyncio.run(
                asyncio.wait_for(released(reader, [(topics["in"], 0), (topics["in"], 1)]), 30)
            )
        assert f"{topics['in']}[0] within" in str(raised.value)
        assert f"{topics['in']}[1]" not in str(raised.value)
    finally:
        producer.abort_transaction(30)


def test_the_offsets_of_a_batch_are_the_next_of_each_partition():
    where = [("a", 0, 5), ("a", 1, 9), ("a", 0, 7), ("b", 0, 2)]
    inputs = [InputRecord(topic, partition, offset, 0, None, None)
              for topic, partition, offset in where]  # fmt: skip
    assert {(tp.topic, tp.partition, tp.offset) for tp in next_offsets(inputs)} == {
        ("a", 0, 8), ("a", 1, 10), ("b", 0, 3)}  # fmt: skip
