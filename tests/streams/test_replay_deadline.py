"""The read-back's deadline bounds its first broker calls too (no broker: a slow fake)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import TopicPartition as KafkaPartition

from streams.replay import AnsweredBefore

PARTITIONS = 12


class SlowBroker:
    """Answers each offsets request after 0.1 s, or after its timeout if shorter."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def _wait(self, timeout: float) -> None:
        self.timeouts.append(timeout)
        time.sleep(min(0.1, timeout))  # the broker's slowness, simulated

    def committed(self, asked, timeout):
        self._wait(timeout)
        return [KafkaPartition(tp.topic, tp.partition, 5) for tp in asked]

    def get_watermark_offsets(self, tp, timeout):
        self._wait(timeout)
        return 0, 10


def test_a_slow_broker_ends_the_check_at_its_deadline_not_after_a_request_per_partition():
    broker = SlowBroker()
    wanted = [("in", p) for p in range(PARTITIONS)]
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        AnsweredBefore._uncommitted(broker, wanted, started + 0.35)
    assert time.monotonic() - started < 0.6  # not 1.3 s, one request per partition
    assert all(timeout <= 0.35 for timeout in broker.timeouts)
