"""Reading topics back from Kafka, as a downstream consumer would.

`TopicReader` consumes topics from the beginning in a background thread and hands
each batch of messages to a handler; `OutcomeCollector` (demo, tests) and the
benchmark's latency reader are built on it. Latency is read time minus the input's
Kafka timestamp.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME, Consumer, Message

from infra.kafka_clients import client_settings
from schemas.codec import AvroDecoder
from streams.outgoing import REDELIVERED


class TopicReader:
    """Consumes `topics` from the earliest offset in a thread owned by this object.

    `handle(messages, read_ms)` runs in that thread and returns how many items it
    kept; `wait_for(count)` blocks until that many were kept or time ran out.
    `isolation_level`: `read_committed` (librdkafka's default) sees records of committed
    transactions only, and each as its transaction commits; `read_uncommitted` sees
    every record written, aborted transactions' included.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topics: list[str],
        handle: Callable[[list[Message], float], int],
        isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
    ) -> None:
        self._consumer = Consumer(
            {
                **client_settings(bootstrap_servers, "reader"),
                "group.id": f"headrace-reader-{uuid.uuid4().hex[:8]}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "isolation.level": isolation_level,
                # A fetch is answered at its first byte (`fetch.min.bytes` 1, the default),
                # so a reader sees each record as it arrives; the wait only bounds an idle
                # fetch. At 5 ms an idle reader made the broker answer 200 empty fetches a
                # second: 0.23-0.54 of a core of a 2-core machine's broker, against 0.04
                # for three readers at this wait.
                "fetch.wait.max.ms": 500,
            }
        )
        self._assigned = threading.Event()
        self._consumer.subscribe(topics, on_assign=lambda *_: self._assigned.set())
        self._handle = handle
        self.count = 0
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="topic-reader", daemon=True)

    def start(self, assigned_within_s: float = 30.0) -> TopicReader:
        """Start reading; returns once the reader's group gave it its partitions, so
        what is written from then on is read within a poll (a reader still joining
        would see the first records late: a test stopping a worker after N answers
        would find it had answered everything)."""
        self._thread.start()
        if not self._assigned.wait(assigned_within_s):
            self.stop()
            raise TimeoutError(f"no partitions assigned within {assigned_within_s:.0f} s")
        return self

    def stop(self) -> None:
        """Stop reading and close the consumer. Safe twice."""
        if not self._stopping.is_set():
            self._stopping.set()
            self._thread.join()
            self._consumer.close()

    def wait_for(self, count: int, timeout_s: float) -> int:
        """Block until `count` items were kept or `timeout_s` passed; return the count."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._changed.wait_for(
                lambda: self.count >= count, max(0.0, deadline - time.monotonic())
            )
            return self.count

    def _run(self) -> None:
        while not self._stopping.is_set():
            # consume(n, timeout) waits for n messages or the timeout: it would add up to
            # the timeout to every latency. Wait for one, then take what is already here.
            first = self._consumer.poll(0.1)
            if first is None:
                continue
            read_ms = time.time() * 1000
            messages = [first, *self._consumer.consume(999, 0)]
            kept = self._handle([m for m in messages if not m.error()], read_ms)
            with self._changed:
                self.count += kept
                self._changed.notify_all()


@dataclass
class DeadLetter:
    key: bytes | None
    value: bytes | None
    headers: dict[str, str]


@dataclass
class Outcomes:
    predictions: list[dict] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.predictions) + len(self.dead_letters)


class OutcomeCollector:
    """Decodes a pipeline's predictions and dead letters, with each prediction's latency."""

    def __init__(
        self,
        bootstrap_servers: str,
        output_topic: str,
        dead_letter_topic: str,
        decoder: AvroDecoder,
        isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
    ) -> None:
        self._output_topic = output_topic
        self._decoder = decoder
        self._outcomes = Outcomes()
        self._lock = threading.Lock()
        self._reader = TopicReader(
            bootstrap_servers, [output_topic, dead_letter_topic], self._keep, isolation_level
        )

    def start(self) -> OutcomeCollector:
        self._reader.start()
        return self

    def stop(self) -> None:
        self._reader.stop()

    def snapshot(self) -> Outcomes:
        with self._lock:
            return Outcomes(list(self._outcomes.predictions), list(self._outcomes.dead_letters))

    def wait_for(self, count: int, timeout_s: float) -> Outcomes:
        """Block until at least `count` outcomes arrived or `timeout_s` passed; return them."""
        self._reader.wait_for(count, timeout_s)
        return self.snapshot()

    def _keep(self, messages: list[Message], read_ms: float) -> int:
        with self._lock:
            for message in messages:
                if message.topic() == self._output_topic:
                    prediction = self._decoder.decode(message.value())
                    prediction["latency_ms"] = read_ms - prediction["event_timestamp_ms"]
                    # On a topic with LogAppendTime: when the broker appended the answer,
                    # i.e. when it became visible to every consumer (not just this one).
                    kind, stamp_ms = message.timestamp()
                    prediction["visible_latency_ms"] = (
                        stamp_ms - prediction["event_timestamp_ms"]
                        if kind == TIMESTAMP_LOG_APPEND_TIME
                        else None
                    )
                    # Else when the worker handed the answer to its Kafka client.
                    prediction["produced_ms"] = stamp_ms if kind == TIMESTAMP_CREATE_TIME else None
                    prediction["key"] = message.key()
                    # Read again after a handover that could not check for a first answer.
                    prediction["redelivered"] = any(
                        name == REDELIVERED for name, _ in message.headers() or ()
                    )
                    self._outcomes.predictions.append(prediction)
                else:
                    headers = {k: v.decode() for k, v in message.headers() or []}
                    self._outcomes.dead_letters.append(
                        DeadLetter(message.key(), message.value(), headers)
                    )
        return len(messages)
