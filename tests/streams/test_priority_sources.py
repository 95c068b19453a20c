"""Where an event's priority comes from, through a real broker and worker: a header the
operator names, else a field of the event, else the default; the default header is not
read once another is named. Priority 0 gets a budget share too small to wait for the
model, so its events are answered by the ladder with reason `low_priority`, and the
others in full: what each event was given shows in its answer."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from tests.helpers import wait_until
from tests.streams.test_worker import collector_for
from tools.loadgen import sample_events

pytestmark = pytest.mark.integration

HEADER = "x-importance"

# event id suffix -> (headers, the `priority` field, whether it is low priority)
CASES = {
    "named-header": ([(HEADER, b"0")], None, True),
    "field": ([], 0, True),
    "header-before-field": ([(HEADER, b"1")], 0, False),
    "neither": ([], None, False),
    "default-header-unread": ([("headrace-priority", b"0")], None, False),
}


def test_priority_comes_from_the_named_header_then_the_field_then_the_default(
    deploy, kafka, sample_assets
):
    deployment = deploy(
        latency_budget_ms=1_000,
        priority={"header": HEADER, "field": "priority", "default": 1,
                  "budget_shares": [0.001, 1.0]},
    )  # fmt: skip
    topic = deployment.spec.input_topic
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{topic}-value")
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    events = sample_events(sample_assets.world, 71, "priority")
    collector = collector_for(deployment)

    def send(event_id: str, headers: list, priority: int | None) -> None:
        event = {**next(events), "event_id": event_id, "priority": priority}
        producer.produce(topic, encoder.encode(event), event["user_id"].encode(),
                         headers=headers)  # fmt: skip
        assert producer.flush(30) == 0

    def answer_of(event_id: str) -> dict | None:
        found = [a for a in collector.snapshot().predictions if a["event_id"] == event_id]
        return found[0] if found else None

    try:
        with deployment.worker():
            send("warm", [], None)  # past start-up: later events are answered in time
            assert wait_until(lambda: answer_of("warm") is not None, 120), deployment.log_tail()
            for name, (headers, priority, _low) in CASES.items():
                for copy in range(3):
                    send(f"{name}-{copy}", headers, priority)
            ids = [f"{name}-{copy}" for name in CASES for copy in range(3)]
            assert wait_until(lambda: all(answer_of(i) for i in ids), 60), deployment.log_tail()
    finally:
        collector.stop()
    for name, (_headers, _priority, low) in CASES.items():
        for copy in range(3):
            answer = answer_of(f"{name}-{copy}")
            if low:
                assert answer["status"] != "OK" and answer["reason"] == "low_priority", answer
            else:
                assert answer["status"] == "OK", answer
