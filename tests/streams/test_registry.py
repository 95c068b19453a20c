"""A user's producer writes through the schema registry with confluent-kafka's own
AvroSerializer; the worker resolves the ids there, and a user's consumer reads the
predictions back with AvroDeserializer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.schema_registry import SchemaRegistryClient, topic_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from schemas.catalogue import load_schema
from tests.helpers import PATIENT_BUDGET_MS, wait_until
from tests.streams.test_worker import offline_scores
from tools.loadgen import sample_events

pytestmark = pytest.mark.integration

N_EVENTS = 100


def test_events_serialized_through_the_registry_are_scored(deploy, kafka, registry,
                                                           sample_assets):  # fmt: skip
    deployment = deploy(registry_url=registry.url, latency_budget_ms=PATIENT_BUDGET_MS)
    spec = deployment.spec
    client = SchemaRegistryClient({"url": registry.url, "timeout": 10})
    # The subject strategy named, not left to the client's default (which first asks the
    # registry for subject associations, a request Apicurio does not answer).
    serializer = AvroSerializer(
        client,
        json.dumps(load_schema("transaction.avsc")),
        conf={"subject.name.strategy": topic_subject_name_strategy},
    )
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    events = sample_events(sample_assets.world, seed=9, prefix="registry")
    sent = {}
    for _ in range(N_EVENTS):
        event = next(events)
        value = serializer(event, SerializationContext(spec.input_topic, MessageField.VALUE))
        producer.produce(spec.input_topic, value, event["user_id"].encode())
        sent[event["event_id"]] = event
    assert producer.flush(30) == 0

    deserializer = AvroDeserializer(client)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "group.id": "registry-test-reader",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([spec.output_topic, spec.dead_letter_topic])
    received: dict[str, dict] = {}
    dead = []

    def read_some() -> bool:
        for message in consumer.consume(500, 0.5):
            if message.error():
                continue
            if message.topic() == spec.dead_letter_topic:
                dead.append(dict(message.headers()))
                continue
            context = SerializationContext(message.topic(), MessageField.VALUE)
            prediction = deserializer(message.value(), context)
            received[prediction["event_id"]] = prediction
        return len(received) + len(dead) >= N_EVENTS

    try:
        with deployment.worker():
            assert wait_until(read_some, timeout_s=120, interval_s=0), deployment.log_tail()
    finally:
        consumer.close()
    assert dead == []
    assert set(received) == set(sent)
    assert {p["status"] for p in received.values()} == {"OK"}
    ids = sorted(received)
    offline = offline_scores(sample_assets.repo, spec, sample_assets.model, [sent[i] for i in ids])
    served = np.array([received[i]["score"] for i in ids], dtype=np.float32)
    np.testing.assert_allclose(served, offline, rtol=1e-5, atol=1e-6)
    # The worker registered the prediction schema under the output topic's subject.
    assert f"{spec.output_topic}-value" in client.get_subjects()
