"""Synthetic transactions for the sample pipeline, sent open-loop at a fixed rate.

Each event's Kafka timestamp is its *intended* send time on the schedule, not the
moment it was actually sent, so a producer that falls behind shows up as latency
instead of hiding it (no coordinated omission).
"""

from __future__ import annotations

import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from confluent_kafka import Producer

from features.sample_data import SampleWorld
from schemas.catalogue import read_schema_file
from schemas.codec import AvroEncoder
from schemas.errors import HeadraceError
from streams.config import PipelineConfig

_CHUNK = 1_000


def sample_events(world: SampleWorld, seed: int, prefix: str | None = None) -> Iterator[dict]:
    """An endless stream of valid transactions with unique ids (`prefix-N`)."""
    rng = np.random.default_rng(seed)
    prefix = prefix or uuid.uuid4().hex[:8]
    count = 0
    while True:
        frame = world.events(_CHUNK, rng)
        for row in frame.to_dict("records"):
            row["event_id"] = f"{prefix}-{count}"
            row["hour_of_day"] = int(row["hour_of_day"])
            row["is_online"] = bool(row["is_online"])
            row["event_time_ms"] = int(time.time() * 1000)
            count += 1
            yield row


def sample_clicks(world: SampleWorld, seed: int, prefix: str | None = None) -> Iterator[dict]:
    """An endless stream of valid click events with unique ids (`prefix-N`)."""
    rng = np.random.default_rng(seed)
    prefix = prefix or uuid.uuid4().hex[:8]
    count = 0
    while True:
        for row in world.click_events(_CHUNK, rng).to_dict("records"):
            row["event_id"] = f"{prefix}-{count}"
            row["dwell_ms"] = int(row["dwell_ms"])
            row["event_time_ms"] = int(time.time() * 1000)
            count += 1
            yield row


@dataclass(frozen=True)
class Example:
    """An example pipeline's events: how to make them, the field they are keyed by (the
    entity whose order matters) and a change that breaks one of its validation rules."""

    events: Callable[[SampleWorld, int, str | None], Iterator[dict]]
    key_field: str
    invalid: dict


# By the record name of the pipeline's input schema.
EXAMPLES = {
    "Transaction": Example(sample_events, "user_id", {"amount": -5.0}),
    "ClickEvent": Example(sample_clicks, "session_id", {"dwell_ms": -1}),
}


def example_of(spec: PipelineConfig) -> Example:
    """The example pipeline `spec` serves (by its input schema's record name)."""
    name = read_schema_file(spec.input.schema_path)["name"] if spec.input.schema_path else None
    if name not in EXAMPLES:
        raise HeadraceError(
            f"pipeline {spec.name} reads {name or spec.input.subject} events; the load "
            f"generator makes only the examples' ({sorted(EXAMPLES)})"
        )
    return EXAMPLES[name]


def events_for(
    spec: PipelineConfig, world: SampleWorld, seed: int, prefix: str | None = None
) -> Iterator[dict]:
    """The sample events of an example pipeline."""
    return example_of(spec).events(world, seed, prefix)


def malformed_records(
    encoder: AvroEncoder, valid: dict, invalid: dict | None = None
) -> dict[str, bytes]:
    """One record per way an input can be unreadable, by the reason code it must get;
    `invalid` breaks a validation rule (default: the fraud example's)."""
    good = encoder.encode(valid)
    return {
        "random_bytes": b"\x9f\x13garbage\xff\x00\x01",
        "bad_magic": b"\x01" + good[1:],
        "unknown_schema": b"\x00" + struct.pack(">I", 987_654) + good[5:],
        "truncated": good[: len(good) - 6],
        "invalid_field": encoder.encode({**valid, **(invalid or {"amount": -5.0})}),
    }


def encoded(events: Iterator[dict], encoder: AvroEncoder) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) pairs of framed events, keyed by the example's entity (user or session)."""
    key = None
    for event in events:
        if key is None:
            key = next(e.key_field for e in EXAMPLES.values() if e.key_field in event)
        yield event[key].encode(), encoder.encode(event)


@dataclass
class SendReport:
    sent: int
    started_s: float
    """Wall-clock time of the first intended send (epoch seconds)."""
    elapsed_s: float
    max_lag_ms: float
    """Worst delay of an actual send behind its schedule."""
    delivered: int = 0
    """Records Kafka acknowledged."""
    failed: int = 0
    """Records Kafka refused, or that timed out; the rest of `sent` were still
    unconfirmed when the final flush gave up."""
    first_error: str | None = None
    """Why the first failed record failed."""
    interrupted: bool = False
    """Ctrl-C ended the run early: `sent` counts what was handed to the producer by then."""


class SendInterrupted(KeyboardInterrupt):
    """Ctrl-C during `send_at_rate`, raised once what was sent is flushed: still a
    KeyboardInterrupt to callers that stop on one, with the report for those that say it."""

    def __init__(self, report: SendReport) -> None:
        super().__init__()
        self.report = report


class NotDelivered(HeadraceError):
    """Not every record sent was acknowledged by Kafka."""

    exit_status = 75  # EX_TEMPFAIL: the broker may take them on a later try


class _Deliveries:
    """Counts delivery reports (called from the producer's `poll` and `flush`)."""

    def __init__(self) -> None:
        self.delivered = 0
        self.failed = 0
        self.first_error: str | None = None

    def on_delivery(self, error, _message) -> None:
        if error is None:
            self.delivered += 1
            return
        self.failed += 1
        if self.first_error is None:
            self.first_error = error.str()


# (key, value), or (key, value, headers).
Record = tuple[bytes, bytes] | tuple[bytes, bytes, list[tuple[str, bytes]]]


MIN_SLEEP_S = 0.001
"""The sender's shortest sleep. A wake-up per record cost the sender half as much CPU
again, on the same cores as the system it measures (2-core machine, 3,200/s: 68-74
against 46-48 µs per event with 1 ms); the benchmarks' producers linger 1 ms anyway,
so records already left in bursts of about that."""


def send_at_rate(
    producer: Producer,
    topic: str,
    records: Iterator[Record],
    rate_per_s: float,
    duration_s: float,
    on_tick: Callable[[int], None] | None = None,
    flush_timeout_s: float = 30.0,
    interrupted_flush_timeout_s: float = 5.0,
) -> SendReport:
    """Send `rate_per_s * duration_s` records on a fixed schedule, open loop.

    Record i is due at `start + i / rate`; each wake-up sends every record already
    due, stamped with its own intended time, so falling behind never slows the
    schedule (and a record sent late counts its lateness as latency). It sleeps at
    least `MIN_SLEEP_S` at a time, sending what fell due meanwhile together. Blocks
    for about `duration_s`, then flushes (up to `flush_timeout_s`: longer than the
    producer's delivery timeout, every record is then either delivered or failed). The
    report counts the deliveries. `on_tick(sent)` is called about once a second
    (progress display).

    Ctrl-C (KeyboardInterrupt) stops the sending: what was sent is still flushed, up to
    `interrupted_flush_timeout_s` (a second Ctrl-C ends that wait), then SendInterrupted
    carries the report.
    """
    total = int(rate_per_s * duration_s)
    deliveries = _Deliveries()
    start = time.time()
    next_tick = start + 1.0
    max_lag_s = 0.0
    sent = 0
    interrupted = False
    try:
        while sent < total:
            now = time.time()
            due = min(total, int((now - start) * rate_per_s) + 1)
            if sent < due:
                max_lag_s = max(max_lag_s, now - (start + sent / rate_per_s))
            while sent < due:
                _produce(producer, topic, next(records), start + sent / rate_per_s, deliveries)
                sent += 1
            producer.poll(0)
            if on_tick is not None and now >= next_tick:
                on_tick(sent)
                next_tick += 1.0
            wait = start + sent / rate_per_s - time.time()
            if wait > 0:
                time.sleep(max(wait, MIN_SLEEP_S))
    except KeyboardInterrupt:
        interrupted = True
    try:
        # Interrupted, the operator waits: flush what was sent, but not for the full
        # delivery timeout (a broker that went away would hold Ctrl-C for 30 s).
        producer.flush(interrupted_flush_timeout_s if interrupted else flush_timeout_s)
    except KeyboardInterrupt:  # (another) Ctrl-C while flushing: stop waiting
        interrupted = True
    # A Ctrl-C between a produce() and its count: the delivery reports know better.
    sent = max(sent, deliveries.delivered + deliveries.failed)
    report = SendReport(
        sent, start, time.time() - start, max_lag_s * 1000,
        deliveries.delivered, deliveries.failed, deliveries.first_error, interrupted,
    )  # fmt: skip
    if interrupted:
        raise SendInterrupted(report)
    return report


def _produce(
    producer: Producer, topic: str, record: Record, at_s: float, deliveries: _Deliveries
) -> None:
    key, value, *headers = record
    while True:
        try:
            producer.produce(
                topic,
                value,
                key,
                timestamp=int(at_s * 1000),
                headers=headers[0] if headers else None,
                on_delivery=deliveries.on_delivery,
            )
            return
        except BufferError:
            producer.poll(0.01)
