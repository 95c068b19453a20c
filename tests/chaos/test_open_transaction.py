"""Exactly-once: an input partition whose committed offset another producer's
transaction holds open (a crashed worker's, until Kafka aborts it) waits, while the
worker's other partitions are answered as fast as ever."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions

from tests.chaos.test_failover import steady_load
from tests.helpers import wait_until
from tests.streams.test_worker import collector_for
from tools.deploy import group_spread

pytestmark = pytest.mark.integration


def open_offset_transaction(bootstrap: str, group: str, topic: str, partition: int) -> Producer:
    """A producer with a transaction left open that holds offset 0 of `partition` for
    `group`, as a worker killed before its commit leaves one: a reader of the group's
    stable offsets waits for it."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"crashed-{uuid.uuid4().hex[:8]}",
            "transaction.timeout.ms": 120_000,
            "socket.timeout.ms": 10_000,
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    metadata = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    producer.send_offsets_to_transaction(
        [TopicPartition(topic, partition, 0)], metadata.consumer_group_metadata(), 30
    )
    metadata.close()
    return producer


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_exactly_once_a_partition_held_by_an_open_transaction_holds_up_no_other(
    chaos_deploy, kafka, sample_assets, runtime
):
    """A partition added under load whose offset another producer's transaction holds
    (as when a crashed worker's partitions move to this one) is not fetched until that
    transaction ends; the partitions the worker had go on being answered at their pace."""
    deployment = chaos_deploy(runtime, delivery="exactly_once", input_partitions=3)
    bootstrap = kafka.bootstrap_servers
    topic, group = deployment.spec.input_topic, deployment.config.app_id
    collector = collector_for(deployment, isolation_level="read_committed")

    def answers(partitions: set[int], sent_after_ms: float = 0) -> list[dict]:
        return [
            p for p in collector.snapshot().predictions
            if p["input_partition"] in partitions and p["event_timestamp_ms"] > sent_after_ms
        ]  # fmt: skip

    try:
        with deployment.worker(), steady_load(kafka, deployment, sample_assets.world, 100):
            assert wait_until(lambda: len(answers({0, 1, 2})) > 200, 120), deployment.log_tail()
            admin = AdminClient({"bootstrap.servers": bootstrap})
            added = admin.create_partitions([NewPartitions(topic, 4)], request_timeout=30)
            added[topic].result(timeout=60)
            held = open_offset_transaction(bootstrap, group, topic, partition=3)
            assert wait_until(lambda: group_spread(bootstrap, group) == [4], 60)
            assigned_ms = time.time() * 1000
            assert wait_until(lambda: len(answers({0, 1, 2}, assigned_ms)) >= 300, 60), (
                deployment.log_tail()
            )
            assert not answers({3}), "answered past another producer's open transaction"
            latencies = sorted(p["latency_ms"] for p in answers({0, 1, 2}, assigned_ms))
            p90_ms = latencies[int(len(latencies) * 0.9)]
            print(f"{runtime}: partitions 0-2 beside a held partition 3: p90 {p90_ms:.0f} ms, "
                  f"max {latencies[-1]:.0f} ms")  # fmt: skip
            # Waiting on the held partition's offset made it seconds (bare: the poll thread
            # held 2 s at a time) or stopped all of them (Faust: the whole assignment's
            # seek); free partitions answer in tens of milliseconds.
            assert p90_ms < 500
            held.abort_transaction(30)
            assert wait_until(lambda: len(answers({3})) > 20, 60), deployment.log_tail()
    finally:
        collector.stop()
