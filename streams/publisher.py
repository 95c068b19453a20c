"""Publishing outcome records with confluent-kafka and awaiting their delivery.

librdkafka delivers in its own threads and reports through callbacks served by
`poll()`; one thread owned by the publisher polls, and each callback resolves an
asyncio future on the loop that produced the record. Idempotence keeps records of
one partition in order across retries.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaException, Producer

from streams.errors import PublishError

DEFAULT_PRODUCER_CONFIG: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # Latency first: send almost at once, still batching what arrives together.
    "linger.ms": 1,
    "delivery.timeout.ms": 30_000,
}


@dataclass(frozen=True)
class OutRecord:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)


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
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []
        for record in records:
            future = loop.create_future()
            futures.append(future)
            while True:
                try:
                    self._producer.produce(
                        record.topic,
                        record.value,
                        record.key,
                        headers=record.headers,
                        on_delivery=_resolver(loop, future),
                    )
                    break
                except BufferError:
                    # librdkafka's local queue is full: let deliveries drain it, then retry.
                    await asyncio.sleep(0.005)
                except KafkaException as exc:
                    raise PublishError(f"cannot produce to {record.topic!r}: {exc}") from exc
        results = await asyncio.gather(*futures, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
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


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    def on_delivery(error, _message) -> None:
        if error is None:
            loop.call_soon_threadsafe(_settle, future, None)
        else:
            loop.call_soon_threadsafe(_settle, future, PublishError(str(error)))

    return on_delivery


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
