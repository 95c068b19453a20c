"""End-to-end latency of every answered event, kept per system under test.

Each outcome is logged as (input Kafka timestamp, latency, status); a step's figures
are the outcomes whose input timestamp lies in its measured window, so warm-up
events and stragglers of another step never count.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from confluent_kafka import Message, Producer
from hdrh.histogram import HdrHistogram

from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroDecoder
from tools.collector import TopicReader
from tools.loadgen import Record, send_at_rate

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
_MAX_US = 600_000_000  # ten minutes: anything later counts as ten minutes
# The load that warms a freshly started broker up (`warm_broker`).
WARM_PER_S = 2_000.0
WARM_S = 5.0


class LatencyLog:
    """Thread-safe log of outcomes: input timestamp (ms), latency (µs) and status."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._input_ms: list[float] = []
        self._latency_us: list[int] = []
        self._status: list[str] = []

    def add(self, input_ms: float, latency_us: int, status: str) -> None:
        with self._lock:
            self._input_ms.append(input_ms)
            self._latency_us.append(latency_us)
            self._status.append(status)

    def window(self, start_ms: float, end_ms: float) -> tuple[np.ndarray, list[str]]:
        """Latencies and statuses of inputs stamped within [start_ms, end_ms)."""
        with self._lock:
            stamps = np.asarray(self._input_ms)
            latencies = np.asarray(self._latency_us, dtype=np.int64)
            statuses = list(self._status)
        inside = (stamps >= start_ms) & (stamps < end_ms)
        return latencies[inside], [s for s, keep in zip(statuses, inside, strict=True) if keep]


@dataclass(frozen=True)
class LatencySummary:
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float

    @classmethod
    def of(cls, latencies_us: np.ndarray) -> LatencySummary:
        histogram = HdrHistogram(1, _MAX_US, 3)
        for value in np.clip(latencies_us, 1, _MAX_US).tolist():
            histogram.record_value(value)
        if histogram.get_total_count() == 0:
            return cls(0, *([float("nan")] * 5))
        p50, p90, p99, p999 = (histogram.get_value_at_percentile(p) / 1000 for p in PERCENTILES)
        return cls(
            histogram.get_total_count(), p50, p90, p99, p999, histogram.get_max_value() / 1000
        )


def prediction_reader(bootstrap: str, topics: list[str], log: LatencyLog) -> TopicReader:
    """Reads prediction records: latency from the input timestamp they carry."""
    # Any answer schema: the latency needs only the fields every answer carries.
    decoder = AvroDecoder(LocalCatalogue(), None)

    def keep(messages: list[Message], read_ms: float) -> int:
        for message in messages:
            prediction = decoder.decode(message.value())
            stamp = prediction["event_timestamp_ms"]
            log.add(stamp, int((read_ms - stamp) * 1000), prediction["status"])
        return len(messages)

    return TopicReader(bootstrap, topics, keep)


def warm_broker(
    bootstrap: str,
    producer: Producer,
    topic: str,
    records: Iterator[Record],
    drain_timeout_s: float = 60.0,
) -> int:
    """Load a freshly started broker before anything is measured, and read the load back.

    A cold JVM compiles its hot paths in the first seconds of traffic, and on a small
    machine its compiler threads take the cores the worker and the load generator need:
    the first step of a bench reached a p99 of 1.1 s, and the demo's first 500 events
    arrived 450 ms late (a plain reader of the input topic saw the same delay).
    Returns the count of records read back."""
    reader = raw_reader(bootstrap, [topic], LatencyLog()).start()
    try:
        report = send_at_rate(producer, topic, records, WARM_PER_S, WARM_S)
        return reader.wait_for(report.sent, drain_timeout_s)
    finally:
        reader.stop()


def raw_reader(bootstrap: str, topics: list[str], log: LatencyLog) -> TopicReader:
    """Reads records as they were produced: latency from their own Kafka timestamp."""

    def keep(messages: list[Message], read_ms: float) -> int:
        for message in messages:
            stamp = message.timestamp()[1]
            log.add(stamp, int((read_ms - stamp) * 1000), "RAW")
        return len(messages)

    return TopicReader(bootstrap, topics, keep)
