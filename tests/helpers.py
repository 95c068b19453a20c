"""Small helpers shared by integration tests: producing events, reading offsets."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from features.sample_data import SampleWorld
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from tools.loadgen import sample_events

# For tests of the data path's correctness: a backlog produced before the worker starts
# must be answered in full, not shed as late.
PATIENT_BUDGET_MS = 600_000


def produce_events(
    bootstrap: str, topic: str, world: SampleWorld, count: int, seed: int, prefix: str
) -> dict[str, dict]:
    """Produce `count` valid events keyed by user id; return them by event id."""
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{topic}-value")
    producer = Producer({"bootstrap.servers": bootstrap})
    sent = {}
    events = sample_events(world, seed, prefix)
    for _ in range(count):
        event = next(events)
        producer.produce(topic, encoder.encode(event), event["user_id"].encode())
        sent[event["event_id"]] = event
    assert producer.flush(30) == 0
    return sent


@contextmanager
def paced_load(
    bootstrap: str, topic: str, world: SampleWorld, per_s: int, prefix: str, chunks_per_s: int = 10
) -> Iterator[None]:
    """Valid events at `per_s` from one producer that stays connected (a producer per
    chunk would add its connection set-up to every event's age), in `chunks_per_s`
    chunks a second (`per_s`: one event at a time), from a thread, until the block ends."""
    stop = threading.Event()
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{topic}-value")
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1})
    events = sample_events(world, 81, prefix)
    chunk = max(1, per_s // chunks_per_s)

    def send() -> None:
        started = time.monotonic()
        for tick in itertools.count():
            if stop.wait(max(0.0, started + tick / chunks_per_s - time.monotonic())):
                return
            for _ in range(chunk):
                event = next(events)
                producer.produce(topic, encoder.encode(event), event["user_id"].encode())
            producer.poll(0)

    sender = threading.Thread(target=send, name="paced-load")
    sender.start()
    try:
        yield
    finally:
        stop.set()
        sender.join(30)
        producer.flush(30)


def produce_raw(bootstrap: str, topic: str, values: list[bytes], key: bytes = b"k") -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for value in values:
        producer.produce(topic, value, key)
    assert producer.flush(30) == 0


def read_messages(bootstrap: str, topics: list[str], count: int, timeout_s: float) -> list:
    """Up to `count` records of `topics` from their start (fewer when `timeout_s` passes)."""
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
    })  # fmt: skip
    consumer.subscribe(topics)
    messages, deadline = [], time.monotonic() + timeout_s
    try:
        while len(messages) < count and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                messages.append(message)
    finally:
        consumer.close()
    return messages


def wait_until(condition, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll `condition()` until true or the deadline passes; return its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def committed_lag(bootstrap: str, group: str, topic: str, partitions: int) -> int:
    """Records of `topic` not yet committed by consumer group `group`."""
    return sum(
        high - max(offset, 0) for offset, high in _committed(bootstrap, group, topic, partitions)
    )


def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> list[int]:
    """Consumer group `group`'s committed offset of each partition (negative: none yet)."""
    return [offset for offset, _high in _committed(bootstrap, group, topic, partitions)]


def records_written(bootstrap: str, topic: str, partitions: int) -> int:
    """Offsets taken on `topic`'s partitions: its records, where nobody writes it in
    transactions (whose markers take offsets too)."""
    return sum(high for _offset, high in _committed(bootstrap, "headrace-tests-none", topic,
                                                     partitions))  # fmt: skip


def _committed(bootstrap: str, group: str, topic: str, partitions: int) -> list[tuple[int, int]]:
    """(committed offset, high watermark) of each partition of `topic`."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        return [
            (tp.offset, consumer.get_watermark_offsets(tp, timeout=10)[1])
            for tp in consumer.committed(tps, timeout=10)
        ]
    finally:
        consumer.close()


def scrape(port: int) -> list[Sample]:
    """The samples of a worker's `/metrics` on a loopback port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


# Seconds a command may take: its imports (Feast, ONNX Runtime) are slow on a busy machine.
COMMAND_TIMEOUT_S = 180


@dataclass
class Finished:
    code: int
    output: str
    """stdout and stderr together."""

    @property
    def lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.strip()]


def headrace(*arguments: str, cwd: Path) -> Finished:
    """Run the installed `headrace` command (or the module where it is not installed)."""
    script = Path(sys.executable).with_name("headrace")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "tools.cli"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")}
    done = subprocess.run(
        [*command, *arguments],
        cwd=cwd,
        env=environment,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    return Finished(done.returncode, done.stdout)
