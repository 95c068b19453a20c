"""Guardrail rules on samples, the meter that feeds them, and the rule in the desired state."""

from __future__ import annotations

import math

import pytest

from streams.control import Desired
from streams.errors import ConfigError
from streams.guardrail import Guardrail, Sample, VersionMeter, breach, p99_ms

pytestmark = pytest.mark.timeout(10)


def batches(n: int, run_ms: float, answers: int = 10, errors: int = 0, mean: float = 0.2):
    ok = answers - errors
    return [Sample(float(i), run_ms / 1000, answers, errors, mean * ok) for i in range(n)]


def test_a_slow_candidate_breaks_the_latency_limit_and_a_close_one_does_not():
    rule = Guardrail(max_p99_increase_ms=20)
    serving = batches(50, 2.0)
    found = breach(rule, serving, batches(5, 40.0))
    assert found is not None and found.reason == "latency"
    assert "p99 40.0 ms" in found.detail and "2.0 ms" in found.detail
    assert breach(rule, serving, batches(5, 21.0)) is None


def test_no_decision_before_each_side_has_enough_answers():
    rule = Guardrail(max_p99_increase_ms=1, min_answers=50)
    assert breach(rule, batches(50, 1.0), batches(4, 100.0)) is None  # 40 candidate answers
    assert breach(rule, batches(4, 1.0), batches(50, 100.0)) is None
    assert breach(rule, batches(5, 1.0), batches(5, 100.0)) is not None


def test_error_rate_and_score_drift():
    rule = Guardrail(max_error_rate=0.01, max_score_drift=0.1)
    serving = batches(10, 1.0, mean=0.2)
    assert breach(rule, serving, batches(10, 1.0, mean=0.25)) is None
    failing = batches(10, 1.0, errors=1, mean=0.2)  # 10 % not numbers
    assert breach(rule, serving, failing).reason == "errors"
    drifted = breach(rule, serving, batches(10, 1.0, mean=0.35))
    assert drifted.reason == "score_drift" and "0.3500" in drifted.detail


def test_p99_counts_each_event_of_a_batch():
    # 99 events in fast batches, one slow batch of 1: the p99 is fast; of 2: slow.
    fast = batches(99, 1.0, answers=1)
    assert p99_ms([*fast, *batches(1, 50.0, answers=1)]) == pytest.approx(1.0)
    assert p99_ms([*fast, *batches(1, 50.0, answers=2)]) == pytest.approx(50.0)
    assert p99_ms([]) == 0.0


def test_a_rule_needs_a_limit_and_bounds():
    with pytest.raises(ConfigError, match="at least one limit"):
        Guardrail()
    with pytest.raises(ConfigError, match="max_error_rate"):
        Guardrail(max_error_rate=1.5)
    with pytest.raises(ConfigError, match="window_s"):
        Guardrail(window_s=0, max_score_drift=0.1)


def test_the_meter_counts_answers_and_keeps_samples_by_time():
    now = [100.0]
    meter = VersionMeter("guardrail-test", "7", clock=lambda: now[0])
    meter.record(0.004, [{"score": 0.25}, {"score": 0.75}, {"score": math.nan}])
    now[0] = 105.0
    meter.record(0.002, [{"value": 3.0}])
    assert meter.since(0.0) == [Sample(100.0, 0.004, 3, 1, 1.0), Sample(105.0, 0.002, 1, 0, 3.0)]
    assert meter.since(101.0) == [Sample(105.0, 0.002, 1, 0, 3.0)]


def test_the_rule_travels_in_the_desired_state_and_ends_with_its_candidate():
    rule = Guardrail(window_s=10, max_p99_increase_ms=5)
    desired = Desired("fraud", serving="1").deploy("2", "canary", 10, rule)
    assert Desired.from_json(desired.to_json()) == desired
    assert Desired.from_json(Desired("fraud").to_json()).guardrail is None
    rolled = desired.rollback("guardrail: latency: p99 ...")
    assert rolled.candidate is None and rolled.guardrail is None and rolled.serving == "1"
    assert rolled.reason.startswith("guardrail") and rolled.revision == desired.revision + 1
    assert desired.promote().guardrail is None
