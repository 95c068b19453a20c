"""A worker's first seconds: every path is warmed before it joins its group, so the load
that arrives once it holds its partitions is answered in full from the first event, at
a rate it sustains later (one run had shed 103 of the first 213 events at 150/s)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.chaos.test_failover import answered
from tests.helpers import paced_load, wait_until
from tests.streams.test_worker import collector_for
from tools.deploy import group_spread

pytestmark = pytest.mark.integration

RATE_PER_S = 150
FIRST = 450  # the first three seconds of the load


# A try whose first answers fall short runs once more, on a fresh worker and topics. A
# cold path sheds in every try (103 of the first 213 in one run); a stall of the shared
# 2-core machine in a 3-second window does not come twice (in two of about twenty full
# suites a warm worker answered 420 and 290 of 450 in full, and all 450 alone).
TRIES = 2
# Where the machine is shared, the worker's own steady state may shed: with a busy loop
# on one of the two cores, its answers at 150/s were 7-24% shed per second (p90 latency
# 31-85 ms of the 100 ms budget), from the first second to the twelfth. The first
# seconds must then do as well as the seconds after them, within a tenth.
SLACK = 0.1


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_the_first_seconds_after_joining_are_answered_in_full(
    deploy, kafka, sample_assets, runtime
):
    tries = []
    for _ in range(TRIES):
        answers = _first_answers(deploy(runtime=runtime), kafka, sample_assets)  # 100 ms
        first, later = (_statuses(part) for part in (answers[:FIRST], answers[FIRST:]))
        print(f"{runtime}: the first {FIRST} answers after joining: {dict(first)}; "
              f"the next {FIRST}: {dict(later)}")  # fmt: skip
        # For a try that falls short: when in its first seconds, and whether the time
        # went before the worker read the events or inside it.
        print("\n".join(_timeline(answers[:FIRST])))
        tries.append((first, later))
        in_full, later_in_full = first[("OK", None)], later[("OK", None)]
        if in_full >= (1 - SLACK) * FIRST or in_full >= later_in_full - SLACK * FIRST:
            return
    pytest.fail(
        f"each try shed or degraded over a tenth of the first {FIRST}, and a tenth more "
        f"than of the next {FIRST}: {tries}"
    )


def _first_answers(deployment, kafka, sample_assets) -> list[dict]:
    """A fresh worker's first `2 * FIRST` answers under paced load that starts once it
    holds its partitions."""
    collector = collector_for(deployment)
    group, topic = deployment.config.app_id, deployment.spec.input_topic
    try:
        with deployment.worker():
            assert wait_until(lambda: group_spread(kafka.bootstrap_servers, group), 120), (
                deployment.log_tail()
            )
            world = sample_assets.world
            with paced_load(kafka.bootstrap_servers, topic, world, RATE_PER_S, "cold"):
                assert wait_until(lambda: answered(collector) >= 2 * FIRST, 60), (
                    deployment.log_tail()
                )
    finally:
        collector.stop()
    return collector.snapshot().predictions[: 2 * FIRST]


def _statuses(answers: list[dict]) -> Counter:
    return Counter((a["status"], a["reason"]) for a in answers)


def _timeline(answers: list[dict], step_ms: int = 500) -> list[str]:
    """Per `step_ms` of event time: answers in full, the events' age when their answers
    were handed to Kafka (median and most), and the sizes of their batches."""
    start_ms = min(a["event_timestamp_ms"] for a in answers)
    steps: dict[int, list[dict]] = {}
    for answer in answers:
        steps.setdefault((answer["event_timestamp_ms"] - start_ms) // step_ms, []).append(answer)
    lines = []
    for step, part in sorted(steps.items()):
        ages = sorted(a["produced_ms"] - a["event_timestamp_ms"] for a in part)
        sizes = sorted(a["timings"]["batch_size"] for a in part)
        lines.append(
            f"{step * step_ms:>5} ms: {_statuses(part)[('OK', None)]:>3}/{len(part)} in full, "
            f"age at hand-over p50 {ages[len(ages) // 2]} max {ages[-1]} ms, "
            f"batches of {sizes[0]}-{sizes[-1]}"
        )
    return lines
