"""The publisher against the test broker: a batch whose plain answers are produced in
one call, with records that carry headers between them."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Producer

from infra.topics import delete_topics
from streams.config import BrokerConfig
from streams.outgoing import REDELIVERED, Outgoing
from streams.publish import Publisher
from streams.records import InputRecord, OutRecord
from tests.chaos.conftest import create_topics
from tests.helpers import read_messages

pytestmark = pytest.mark.integration

KEYS = [f"user-{n}".encode() for n in range(5)]


@pytest.fixture
def topics(kafka) -> Iterator[dict[str, str]]:
    suffix = uuid.uuid4().hex[:8]
    names = {"out": f"out-{suffix}", "dlq": f"dlq-{suffix}", "probe": f"probe-{suffix}"}
    create_topics(
        kafka.bootstrap_servers,
        {name: (1 if role == "dlq" else 3, {}) for role, name in names.items()},
    )
    yield names
    delete_topics(kafka.bootstrap_servers, list(names.values()))


def test_answers_and_headed_records_of_a_batch_are_written_in_order_per_key(kafka, topics):
    bootstrap = kafka.bootstrap_servers
    records, inputs = [], []
    for n in range(30):
        key = KEYS[n % len(KEYS)]
        inputs.append(InputRecord("in", 0, n, 0, key, b"input"))
        headers = [(REDELIVERED, b"1")] if n == 20 else []
        topic = topics["dlq"] if n == 10 else topics["out"]
        if n == 10:
            headers = [("headrace.error.reason", b"bad_magic")]
        records.append(OutRecord(topic, key, n.to_bytes(4, "big"), headers))
    publisher = Publisher(BrokerConfig(bootstrap_servers=bootstrap), topics.values())
    publisher.start()
    try:
        batch = Outgoing(records, inputs, "fraud", topics["dlq"])
        asyncio.run(asyncio.wait_for(publisher.publish(batch), 30))
    finally:
        publisher.stop()
    assert batch.delivered == [True] * 30

    written = read_messages(bootstrap, [topics["out"]], 29, 30)
    assert len(written) == 29
    by_key: dict[bytes, list[tuple[int, int]]] = {}
    for message in written:
        by_key.setdefault(message.key(), []).append(
            (message.partition(), int.from_bytes(message.value(), "big"))
        )
    # librdkafka's partitioner puts a probe of each key where a plain produce() would.
    probe = Producer({"bootstrap.servers": bootstrap})
    for key in KEYS:
        probe.produce(topics["probe"], b"", key)
    assert probe.flush(30) == 0
    probed = {m.key(): m.partition() for m in read_messages(bootstrap, [topics["probe"]], 5, 30)}
    for key, written_of_key in by_key.items():
        assert {partition for partition, _ in written_of_key} == {probed[key]}
        numbers = [number for _, number in written_of_key]
        assert numbers == sorted(numbers)  # in batch order
    assert sorted(n for w in by_key.values() for _, n in w) == [n for n in range(30) if n != 10]
    (redelivered,) = [m for m in written if int.from_bytes(m.value(), "big") == 20]
    assert redelivered.headers() == [(REDELIVERED, b"1")]
    (letter,) = read_messages(bootstrap, [topics["dlq"]], 1, 30)
    assert letter.headers() == [("headrace.error.reason", b"bad_magic")]
