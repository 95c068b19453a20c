"""The check at an assignment, against the real broker: inputs past the committed offset
found answered are skipped, and those whose earlier answers it cannot see are marked."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka import TopicPartition as KafkaPartition

from infra.kafka_clients import client_settings
from infra.topics import delete_topics, ensure_topics
from streams.replay import AnsweredBefore, OutcomeTopics, Replay

pytestmark = pytest.mark.integration

INPUTS = 6


@pytest.fixture
def topics(kafka):
    suffix = uuid.uuid4().hex[:8]
    names = {"input": f"replay-in-{suffix}", "output": f"replay-out-{suffix}",
             "dead": f"replay-dlq-{suffix}"}  # fmt: skip
    ensure_topics(kafka.bootstrap_servers, {name: 2 for name in names.values()})
    yield names
    delete_topics(kafka.bootstrap_servers, names.values())


def write(bootstrap: str, topic: str, partition: int, count: int, written_s_ago: float) -> None:
    producer = Producer(client_settings(bootstrap, "test"))
    stamp_ms = int((time.time() - written_s_ago) * 1000)
    for i in range(count):
        producer.produce(topic, b"v%d" % i, partition=partition, timestamp=stamp_ms)
    assert producer.flush(10) == 0


def write_in_a_transaction(bootstrap: str, topic: str, count: int) -> None:
    """`count` inputs on each of partitions 0 and 1, in one committed transaction: a
    marker follows the last input of each."""
    producer = Producer(
        {**client_settings(bootstrap, "test"), "transactional.id": f"up-{uuid.uuid4().hex}"}
    )
    producer.init_transactions(10)
    producer.begin_transaction()
    for partition in (0, 1):
        for i in range(count):
            producer.produce(topic, b"v%d" % i, partition=partition)
    producer.commit_transaction(10)


def dead_letter_of(bootstrap: str, topics: dict, offset: int) -> None:
    """An outcome naming input `offset` of partition 0, written now."""
    producer = Producer(client_settings(bootstrap, "test"))
    headers = [
        ("headrace.input.topic", topics["input"].encode()),
        ("headrace.input.partition", b"0"),
        ("headrace.input.offset", b"%d" % offset),
    ]
    producer.produce(topics["dead"], b"", headers=headers, partition=0)
    assert producer.flush(10) == 0


def commit(bootstrap: str, group: str, topic: str, offsets: dict[int, int]) -> None:
    consumer = Consumer({**client_settings(bootstrap, "test"), "group.id": group})
    try:
        consumer.commit(
            offsets=[KafkaPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False
        )
    finally:
        consumer.close()


def check(bootstrap: str, topics: dict, group: str, lookback_s: float) -> dict:
    outcomes = {topics["input"]: OutcomeTopics(topics["output"], topics["dead"])}
    answered_before = AnsweredBefore(
        client_settings(bootstrap, "replay-check"), group, outcomes, None, lookback_s
    )
    return answered_before.scan([(topics["input"], 0), (topics["input"], 1)])


@pytest.mark.timeout(60)
def test_inputs_past_the_commit_found_answered_are_skipped_and_the_rest_marked(kafka, topics):
    """Answers past the commit: the worker that wrote them stopped without handing over,
    and if it was only frozen it may answer 4 and 5 after this check: marked."""
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    write(bootstrap, topics["input"], 0, INPUTS, written_s_ago=0)
    write(bootstrap, topics["input"], 1, INPUTS, written_s_ago=0)
    commit(bootstrap, group, topics["input"], {0: 2, 1: 3})
    for offset in (2, 3):  # answered by a worker that stopped before committing them
        dead_letter_of(bootstrap, topics, offset)
    found = check(bootstrap, topics, group, lookback_s=120)
    assert found == {
        (topics["input"], 0): Replay(frozenset({2, 3}), range(2, INPUTS)),
        (topics["input"], 1): Replay(),  # nothing answered past its commit: handed over
    }


@pytest.mark.timeout(60)
def test_a_partition_with_nothing_past_its_commit_is_checked_as_empty(kafka, topics):
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    write(bootstrap, topics["input"], 0, INPUTS, written_s_ago=0)
    commit(bootstrap, group, topics["input"], {0: 2})
    found = check(bootstrap, topics, group, lookback_s=120)
    assert found == {(topics["input"], 0): Replay(), (topics["input"], 1): Replay()}


@pytest.mark.timeout(60)
def test_inputs_older_than_the_lookback_are_marked_except_those_found(kafka, topics):
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    # Written 10 minutes ago: a group down longer than the lookback reaches back.
    write(bootstrap, topics["input"], 0, INPUTS, written_s_ago=600)
    commit(bootstrap, group, topics["input"], {0: 2})
    dead_letter_of(bootstrap, topics, 2)
    found = check(bootstrap, topics, group, lookback_s=120)
    assert found[(topics["input"], 0)] == Replay(frozenset({2}), range(2, INPUTS))


@pytest.mark.timeout(60)
def test_with_no_lookback_inputs_past_the_commit_are_marked_if_the_group_ever_committed(
    kafka, topics
):
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    write(bootstrap, topics["input"], 0, INPUTS, written_s_ago=0)
    write(bootstrap, topics["input"], 1, INPUTS, written_s_ago=0)
    commit(bootstrap, group, topics["input"], {0: 4})  # partition 1: never committed
    dead_letter_of(bootstrap, topics, 4)  # not read back: the lookback is 0
    found = check(bootstrap, topics, group, lookback_s=0)
    assert found == {
        (topics["input"], 0): Replay(unchecked=range(4, INPUTS)),
        (topics["input"], 1): Replay(),  # nothing was handed over: a first start
    }


@pytest.mark.timeout(60)
def test_a_partition_committed_up_to_its_transaction_marker_is_checked_as_empty(kafka, topics):
    """Inputs written in transactions: a partition answered in full has its committed
    offset on the marker after its last input, where no record can be read. The check
    waited for one there until its deadline, and then lost what it found for the others."""
    bootstrap, group = kafka.bootstrap_servers, f"g-{uuid.uuid4().hex[:8]}"
    write_in_a_transaction(bootstrap, topics["input"], INPUTS)
    commit(bootstrap, group, topics["input"], {0: 2, 1: INPUTS})  # 1: up to its marker
    for offset in (2, 3):
        dead_letter_of(bootstrap, topics, offset)
    found = check(bootstrap, topics, group, lookback_s=120)
    assert found == {
        (topics["input"], 0): Replay(frozenset({2, 3}), range(2, INPUTS + 1)),  # + its marker
        (topics["input"], 1): Replay(),
    }
