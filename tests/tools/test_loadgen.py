"""The load generator counts what Kafka acknowledged, not what it handed over."""

from __future__ import annotations

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

    def produce(self, topic, value, key, timestamp, headers, on_delivery) -> None:
        self._count += 1
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
