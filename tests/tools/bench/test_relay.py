"""The relay baseline against a real broker: every record comes back, with figures."""

from __future__ import annotations

import math

import pytest

from tools.bench.relay import measure

pytestmark = pytest.mark.integration


def test_the_relay_returns_every_record_and_reports_its_cost(kafka):
    result = measure(kafka.bootstrap_servers, rate=50, seconds=2,
                     consumer_settings={"fetch.min.bytes": 1}, idle_s=0.5)  # fmt: skip

    assert result.sent == 100 and result.answered == 100
    assert result.cpu_us_per_event > 0 and result.idle_cores >= 0
    assert 0 < result.p50_ms <= result.p99_ms and not math.isnan(result.p99_ms)
