"""Deployments for fault tests: the sample pipeline with topics created with the
configs a fault needs (an input topic that accepts 5 MB records), and a reader that
counts the outcomes of each input over the whole output and dead-letter topics
(`read_outcomes` reads them to their ends, committed transactions only or all)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Literal

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

from infra.topics import delete_topics
from models.train import fallback_path
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroDecoder
from tests.conftest import Deployment
from tests.helpers import PATIENT_BUDGET_MS, wait_until
from tests.streams.test_worker import collector_for
from tools.collector import DeadLetter, Outcomes
from tools.deploy import sample_config, write_config

# An input topic that accepts records of up to 8 MiB (Kafka's default is about 1 MB).
BIG_INPUT_BYTES = 8 * 1024 * 1024


def create_topics(bootstrap: str, topics: Mapping[str, tuple[int, dict[str, str]]]) -> None:
    """Create each topic with its partition count and configs (set at creation, so that
    no producer can race a config change)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    wanted = [
        NewTopic(name, num_partitions=partitions, replication_factor=1, config=configs)
        for name, (partitions, configs) in topics.items()
    ]
    for future in admin.create_topics(wanted, operation_timeout=30, request_timeout=30).values():
        future.result(timeout=60)


@pytest.fixture
def chaos_deploy(kafka, sample_assets, tmp_path):
    """Factory: `chaos_deploy(runtime, input_configs={...}, input_partitions=3,
    **sample_config overrides)`: the sample pipeline on its own topics (input:
    `input_partitions` with `input_configs`; output: 3 partitions; dead letters: 1),
    answering patiently (no deadline shedding)."""
    created: list[str] = []
    made: list[Deployment] = []

    def make(
        runtime: str,
        input_configs: dict[str, str] | None = None,
        input_partitions: int = 3,
        **overrides,
    ) -> Deployment:
        suffix = f"-{uuid.uuid4().hex[:8]}"
        overrides.setdefault("fallback_model", fallback_path(sample_assets.model))
        overrides.setdefault("latency_budget_ms", PATIENT_BUDGET_MS)
        raw = sample_config(kafka.bootstrap_servers, sample_assets.repo, sample_assets.model,
                            suffix=suffix, runtime=runtime, **overrides)  # fmt: skip
        config_file = tmp_path / f"headrace{suffix}.yaml"
        config = write_config(raw, config_file)
        spec = config.pipelines[0]
        topics = {
            spec.input_topic: (input_partitions, input_configs or {}),
            spec.output_topic: (3, {}),
            spec.dead_letter_topic: (1, {}),
        }
        created.extend(topics)
        create_topics(kafka.bootstrap_servers, topics)
        made.append(Deployment(config, config_file, tmp_path / f"worker{suffix}.log"))
        return made[-1]

    yield make
    for deployment in made:
        deployment.kill_leftovers()
    if created:
        delete_topics(kafka.bootstrap_servers, created)


def produce_in_order(
    bootstrap: str, topic: str, values: Iterable[tuple[bytes, bytes]], partition: int
) -> list[int]:
    """Write (key, value) records to one partition in order; return their offsets."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "message.max.bytes": BIG_INPUT_BYTES,
            "linger.ms": 5,
        }
    )
    offsets: dict[int, int] = {}

    def delivered(index: int):
        def report(error, message) -> None:
            if error is not None:
                raise KafkaException(error)
            offsets[index] = message.offset()

        return report

    count = 0
    for index, (key, value) in enumerate(values):
        producer.produce(topic, value, key, partition=partition, on_delivery=delivered(index))
        count += 1
    assert producer.flush(60) == 0
    return [offsets[index] for index in range(count)]


def outcomes_per_input(outcomes: Outcomes, input_topic: str) -> Counter:
    """(partition, offset) of each input -> how many outcomes name it, over the whole
    output and dead-letter topics as read."""
    counts: Counter = Counter()
    for answer in outcomes.predictions:
        if answer["input_topic"] == input_topic:
            counts[(answer["input_partition"], answer["input_offset"])] += 1
    for letter in outcomes.dead_letters:
        if letter.headers.get("headrace.input.topic") == input_topic:
            where = (int(letter.headers["headrace.input.partition"]),
                     int(letter.headers["headrace.input.offset"]))  # fmt: skip
            counts[where] += 1
    return counts


def input_offsets(bootstrap: str, topic: str) -> set[tuple[int, int]]:
    """Every (partition, offset) of `topic` from its watermarks (no transactions write
    these topics, so offsets are contiguous)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"offsets-{uuid.uuid4()}"})
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics[topic]
        offsets = set()
        for partition in metadata.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), 30)
            offsets.update((partition, offset) for offset in range(low, high))
        return offsets
    finally:
        consumer.close()


def read_outcomes(
    deployment: Deployment,
    isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
    timeout_s: float = 60.0,
) -> Outcomes:
    """Every outcome in the pipeline's output and dead-letter topics, read from the
    beginning to the end each partition has now (Kafka's end-of-partition events: a
    topic written in transactions ends with a marker, not a record). `read_committed`
    reads the records of committed transactions only, `read_uncommitted` aborted ones'
    too. Written for a stopped worker: an open transaction's records never end a
    read_committed read."""
    spec = deployment.spec
    bootstrap = deployment.config.broker.bootstrap_servers
    decoder = AvroDecoder(LocalCatalogue(), "prediction.avsc")
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"outcomes-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": isolation_level,
        }
    )
    outcomes = Outcomes()
    try:
        ends = {}
        for topic in (spec.output_topic, spec.dead_letter_topic):
            for partition in consumer.list_topics(topic, timeout=30).topics[topic].partitions:
                where = TopicPartition(topic, partition)
                ends[(topic, partition)] = consumer.get_watermark_offsets(where, timeout=30)[1]
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in ends])
        pending = {where for where, end in ends.items() if end > 0}
        deadline = time.monotonic() + timeout_s
        while pending:
            assert time.monotonic() < deadline, f"not read to their ends: {sorted(pending)}"
            for message in consumer.consume(1000, 0.5):
                where = (message.topic(), message.partition())
                error = message.error()
                if error is not None:
                    if (
                        error.code() == KafkaError._PARTITION_EOF
                        and message.offset() >= ends[where]
                    ):
                        pending.discard(where)
                    continue
                if message.topic() == spec.output_topic:
                    answer = decoder.decode(message.value())
                    # Where and when it was written: what tells repeats apart.
                    answer["written_at"] = (message.partition(), message.offset(),
                                            message.timestamp()[1])  # fmt: skip
                    outcomes.predictions.append(answer)
                else:
                    headers = {k: v.decode() for k, v in message.headers() or []}
                    outcomes.dead_letters.append(
                        DeadLetter(message.key(), message.value(), headers)
                    )
    finally:
        consumer.close()
    return outcomes


def served_to_the_end(deployment: Deployment, inputs: set, timeout_s: float) -> Outcomes:
    """Run a worker on what is already in the input topic until it has written an
    outcome for each of `inputs` (it must not end meanwhile); every outcome it wrote,
    read over the whole output and dead-letter topics."""
    collector = collector_for(deployment)
    try:
        with deployment.worker() as worker:
            wait_until(
                lambda: len(collector.snapshot()) >= len(inputs) or worker.poll() is not None,
                timeout_s,
            )
            assert worker.poll() is None, f"the worker ended:\n{deployment.log_tail()}"
            assert len(collector.snapshot()) >= len(inputs), deployment.log_tail()
        return collector.snapshot()
    finally:
        collector.stop()
