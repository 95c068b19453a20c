"""Publish: outcome records written with confluent-kafka, delivery awaited; and the
dead-letter record of an input that cannot be answered.

librdkafka delivers in its own threads and reports through callbacks served by
`poll()`; one thread owned by the publisher polls. A batch's callbacks count down in
that thread and the last one resolves the batch's future on the loop that produced
it. Idempotence keeps records of one partition in order across retries.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

from confluent_kafka import KafkaException, Producer

from schemas.errors import DecodeError
from schemas.validation import InvalidEventError
from streams.errors import PublishError
from streams.records import InputRecord, OutRecord

log = logging.getLogger(__name__)

DEFAULT_PRODUCER_CONFIG: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # Latency first: send almost at once, still batching what arrives together.
    "linger.ms": 1,
    "delivery.timeout.ms": 30_000,
}


def dead_letter(record: InputRecord, error: DecodeError, pipeline: str, topic: str) -> OutRecord:
    """The input's own key and bytes, with why and where it came from in headers."""
    log.warning(
        "dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, error
    )
    headers = [
        ("headrace.error.reason", error.reason.encode()),
        ("headrace.error.message", str(error).encode()),
        ("headrace.pipeline", pipeline.encode()),
        ("headrace.input.topic", record.topic.encode()),
        ("headrace.input.partition", str(record.partition).encode()),
        ("headrace.input.offset", str(record.offset).encode()),
    ]
    if isinstance(error, InvalidEventError):
        headers.append(("headrace.error.rule", f"{error.field}.{error.rule}".encode()))
    return OutRecord(topic, record.key, record.value, headers)


class Publisher:
    """`await publish(records)` returns once Kafka has acknowledged every record."""

    def __init__(self, bootstrap_servers: str, overrides: dict[str, Any] | None = None) -> None:
        config = {**DEFAULT_PRODUCER_CONFIG, "bootstrap.servers": bootstrap_servers}
        self._producer = Producer({**config, **(overrides or {})})
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None

    def start(self) -> None:
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="kafka-delivery", daemon=True)
            self._poller.start()

    async def publish(self, records: Sequence[OutRecord]) -> None:
        """Produce `records` in order, wait for every delivery; raise PublishError on a failure."""
        if not records:
            return
        delivery = _BatchDelivery(asyncio.get_running_loop(), len(records))
        for record in records:
            while True:
                try:
                    self._producer.produce(
                        record.topic,
                        record.value,
                        record.key,
                        headers=record.headers,
                        on_delivery=delivery.on_delivery,
                    )
                    break
                except BufferError:
                    # librdkafka's local queue is full: let deliveries drain it, then retry.
                    await asyncio.sleep(0.005)
                except KafkaException as exc:
                    raise PublishError(f"cannot produce to {record.topic!r}: {exc}") from exc
        failures = await delivery.done
        if failures:
            raise PublishError(
                f"{len(failures)} of {len(records)} records were not delivered: {failures[0]}"
            )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Deliver what is queued (up to `timeout_s`), then stop the poll thread. Safe twice."""
        self._producer.flush(timeout_s)
        self._stopping.set()
        if self._poller is not None:
            self._poller.join()
            self._poller = None

    def _poll(self) -> None:
        while not self._stopping.is_set():
            self._producer.poll(0.05)


class _BatchDelivery:
    """Counts the delivery reports of one batch in the poll thread and wakes the loop
    once, when the last one arrives: one hand-off per batch instead of one per record."""

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        self._loop = loop
        self._pending = count
        self._failures: list[str] = []
        self.done: asyncio.Future[list[str]] = loop.create_future()

    def on_delivery(self, error, _message) -> None:
        # Runs in the poll thread only (librdkafka serves callbacks from `poll`).
        if error is not None:
            self._failures.append(str(error))
        self._pending -= 1
        if self._pending == 0:
            self._loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        if not self.done.done():  # not cancelled meanwhile
            self.done.set_result(self._failures)
