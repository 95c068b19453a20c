"""Reading a pipeline's outcomes back from Kafka, as a downstream consumer would.

Used by the demo, the tests and the benchmark: a background thread consumes the
output and dead-letter topics from the beginning, decodes predictions, and records
each outcome's end-to-end latency (read time minus the input's Kafka timestamp).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import Consumer

from schemas.codec import AvroDecoder


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
    """Collects outcomes in a thread; `wait_for` blocks until enough arrived or time ran out."""

    def __init__(
        self,
        bootstrap_servers: str,
        output_topic: str,
        dead_letter_topic: str,
        decoder: AvroDecoder,
    ) -> None:
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap_servers,
                "group.id": f"headrace-collector-{uuid.uuid4().hex[:8]}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 5,
            }
        )
        self._output_topic = output_topic
        self._consumer.subscribe([output_topic, dead_letter_topic])
        self._decoder = decoder
        self._outcomes = Outcomes()
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outcome-collector", daemon=True)

    def start(self) -> OutcomeCollector:
        self._thread.start()
        return self

    def stop(self) -> None:
        if not self._stopping.is_set():
            self._stopping.set()
            self._thread.join()
            self._consumer.close()

    def snapshot(self) -> Outcomes:
        with self._changed:
            return Outcomes(list(self._outcomes.predictions), list(self._outcomes.dead_letters))

    def wait_for(self, count: int, timeout_s: float) -> Outcomes:
        """Block until at least `count` outcomes arrived or `timeout_s` passed; return them."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._changed.wait_for(
                lambda: len(self._outcomes) >= count, max(0.0, deadline - time.monotonic())
            )
        return self.snapshot()

    def _run(self) -> None:
        while not self._stopping.is_set():
            messages = self._consumer.consume(500, 0.1)
            if not messages:
                continue
            read_ms = time.time() * 1000
            with self._changed:
                for message in messages:
                    if message.error():
                        continue
                    if message.topic() == self._output_topic:
                        prediction = self._decoder.decode(message.value())
                        prediction["latency_ms"] = read_ms - prediction["event_timestamp_ms"]
                        prediction["key"] = message.key()
                        self._outcomes.predictions.append(prediction)
                    else:
                        headers = {k: v.decode() for k, v in message.headers() or []}
                        self._outcomes.dead_letters.append(
                            DeadLetter(message.key(), message.value(), headers)
                        )
                self._changed.notify_all()
