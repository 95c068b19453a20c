"""The load generator counts what Kafka acknowledged, not what it handed over."""

from __future__ import annotations

import time

from tools import loadgen
from tools.loadgen import send_at_rate


class Refused:
    def str(self) -> str:
        return "Broker: Message size too large"


class FakeProducer:
    """Reports every third record failed, when polled or flushed; `stuck` records are
    never reported (still in flight when the flush gives up)."""

    def __init__(self, stuck: int = 0) -> None:
        self._reports = []
        self._count = 0
        self._stuck = stuck
        self.timestamps: list[int] = []

    def produce(self, topic, value, key, timestamp, headers, on_delivery) -> None:
        self._count += 1
        self.timestamps.append(timestamp)
        if self._count > self._stuck:
            self._reports.append((Refused() if self._count % 3 == 0 else None, on_delivery))

    def poll(self, _timeout: float) -> int:
        reports, self._reports = self._reports, []
        for error, on_delivery in reports:
            on_delivery(error, None)
        return len(reports)

    def flush(self, _timeout: float) -> int:
        self.poll(0)
        return self._stuck


def records():
    while True:
        yield b"k", b"v"


def test_deliveries_and_failures_are_counted():
    report = send_at_rate(FakeProducer(), "t", records(), rate_per_s=1_000, duration_s=0.03)
    assert (report.sent, report.delivered, report.failed) == (30, 20, 10)
    assert report.first_error == "Broker: Message size too large"


def test_records_never_reported_are_neither_delivered_nor_failed():
    report = send_at_rate(FakeProducer(stuck=6), "t", records(), 1_000, 0.03)
    assert (report.sent, report.delivered, report.failed) == (30, 16, 8)


def test_a_high_rate_is_sent_in_bursts_stamped_with_each_records_own_time(monkeypatch):
    """A wake-up per record cost the sender half as much CPU again at 3,200/s, on the
    cores of the system it measures; lateness still counts, as each record keeps its
    own time."""
    sleeps: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(loadgen.time, "sleep", sleep)
    producer = FakeProducer()
    report = loadgen.send_at_rate(producer, "t", records(), rate_per_s=20_000, duration_s=0.1)

    assert report.sent == 2_000
    assert len(sleeps) <= 0.1 / loadgen.MIN_SLEEP_S + 5  # a sleep a millisecond, not a record
    assert min(sleeps) >= loadgen.MIN_SLEEP_S
    gaps = {b - a for a, b in zip(producer.timestamps, producer.timestamps[1:], strict=False)}
    assert gaps <= {0, 1}  # whole milliseconds apart: each record's intended time


def test_ctrl_c_flushes_what_was_sent_then_raises_with_the_report():
    """Still a KeyboardInterrupt (the demo and the benchmarks stop on it), raised after
    the flush, carrying what was sent and delivered for `produce` to say."""
    flushed: list[float] = []

    class Interrupted(FakeProducer):
        def produce(self, *args, **kwargs) -> None:
            if self._count == 12:
                raise KeyboardInterrupt
            super().produce(*args, **kwargs)

        def flush(self, timeout: float) -> int:
            flushed.append(timeout)
            return super().flush(timeout)

    try:
        send_at_rate(Interrupted(), "t", records(), 1_000, 10.0, interrupted_flush_timeout_s=2.0)
    except KeyboardInterrupt as raised:
        assert isinstance(raised, loadgen.SendInterrupted)
        report = raised.report
    else:
        raise AssertionError("the interrupt was swallowed")
    assert flushed == [2.0]
    assert report.interrupted
    assert (report.sent, report.delivered, report.failed) == (12, 8, 4)
