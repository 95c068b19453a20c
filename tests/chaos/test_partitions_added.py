"""Partitions added to a live input topic (the way an operator scales a topic out): a
running worker starts serving them within seconds, not after its client's next periodic
metadata refresh (librdkafka's and aiokafka's defaults: five minutes)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import AdminClient, NewPartitions

from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from tests.chaos.conftest import produce_in_order
from tests.helpers import produce_events, wait_until
from tests.streams.test_worker import collector_for
from tools.loadgen import sample_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

BEFORE, AFTER = 2, 4
# The config's metadata refresh bounds how soon a worker sees the new partitions; a
# rebalance follows, then their first fetch.
SERVED_WITHIN_S = 30


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_partitions_added_to_the_input_are_served_within_seconds(
    chaos_deploy, kafka, sample_assets, runtime
):
    deployment = chaos_deploy(runtime, input_partitions=BEFORE)
    topic = deployment.spec.input_topic
    collector = collector_for(deployment)
    try:
        with deployment.worker():
            produce_events(kafka.bootstrap_servers, topic, sample_assets.world, 1, 0, "ready")
            assert len(collector.wait_for(1, 120)) == 1, deployment.log_tail()

            admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
            futures = admin.create_partitions([NewPartitions(topic, AFTER)], request_timeout=30)
            futures[topic].result(timeout=60)
            encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{topic}-value")
            events = sample_events(sample_assets.world, 3, "new-")
            added = time.monotonic()
            for partition in range(BEFORE, AFTER):
                values = [(e["user_id"].encode(), encoder.encode(e))
                          for e in (next(events) for _ in range(5))]  # fmt: skip
                produce_in_order(kafka.bootstrap_servers, topic, values, partition)

            def new_partitions_answered() -> bool:
                answered = {a["input_partition"] for a in collector.snapshot().predictions}
                return set(range(BEFORE, AFTER)) <= answered

            served = wait_until(new_partitions_answered, SERVED_WITHIN_S)
            took_s = time.monotonic() - added
            print(f"{runtime}: partitions {BEFORE}..{AFTER - 1} served after {took_s:.1f} s")
            assert served, deployment.log_tail()
    finally:
        collector.stop()
