"""Overload through a real broker: deadlines, the ladder, priorities, recovery, audit.

One worker run per runtime (module fixture) goes through three phases: a ramp of
doubling rates, whose highest rate of answers in full is the pipeline's measured
capacity; three times that capacity, with priorities alternating high and low; then half
the capacity. The model is a heavy synthetic one, so that the model, not the machine's
Kafka and Python plumbing, bounds capacity. The tests below each check one property of
that run.
"""

from __future__ import annotations

import itertools
import urllib.request
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from infra.ports import free_port
from infra.topics import delete_topics, set_topic_config
from models.synthetic import write_heavy_model
from models.train import fallback_path
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from streams.app import create_topics
from tests.conftest import Deployment
from tests.helpers import produce_events, wait_until
from tests.streams.test_worker import collector_for
from tools.audit import audit, format_report
from tools.bench.harness import HEAVY_MODEL
from tools.deploy import sample_config, write_config
from tools.loadgen import sample_events, send_at_rate

pytestmark = pytest.mark.integration

BUDGET_MS = 250.0
HIGH, LOW = 1, 0  # the default budget shares: normal (the whole budget) and low (half)
RAMP_START_PER_S = 50.0
RAMP_STEP_S = 3.0
RAMP_STEPS = 7  # up to 3,200/s: the heavy model saturates well before
# Seconds of the calm phase after which nearly every event must be answered in full.
RECOVERY_S = 3.0


@dataclass
class Phase:
    name: str
    rate: float
    seconds: float
    priorities: dict[str, int]
    """Event id -> the priority header it was sent with."""
    started_s: float = 0.0


def _records(world, phase: Phase, encoder: AvroEncoder, priorities):
    for event, priority in zip(sample_events(world, 7, phase.name), priorities, strict=False):
        phase.priorities[event["event_id"]] = priority
        header = [("headrace-priority", str(priority).encode())]
        yield event["user_id"].encode(), encoder.encode(event), header


def _run(producer, topic, world, encoder, phase: Phase, priorities) -> None:
    report = send_at_rate(
        producer, topic, _records(world, phase, encoder, priorities), phase.rate, phase.seconds
    )
    phase.started_s = report.started_s


def _outcomes_counted(metrics: dict[tuple, float]) -> Counter:
    counted = Counter()
    for (name, labels), value in metrics.items():
        if name == "headrace_outcomes_total":
            counted[dict(labels)["status"]] += int(value)
    return counted


def _scrape(port: int) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture(scope="module", params=["bare", "faust"])
def overload(request, kafka, sample_assets, tmp_path_factory):
    runtime = request.param
    tmp = tmp_path_factory.mktemp(f"overload-{runtime}")
    port = free_port()
    heavy = write_heavy_model(sample_assets.model, tmp / "heavy.onnx", **HEAVY_MODEL)
    config = write_config(
        sample_config(
            kafka.bootstrap_servers,
            sample_assets.repo,
            heavy,
            suffix=f"-overload-{runtime}",
            runtime=runtime,
            metrics_port=port,
            max_batch_size=16,
            latency_budget_ms=BUDGET_MS,
            fallback_model=fallback_path(sample_assets.model),
        ),
        tmp / "headrace.yaml",
    )
    created = create_topics(config, 3)
    deployment = Deployment(config, tmp / "headrace.yaml", tmp / "worker.log")
    spec = deployment.spec
    # End to end is until the answer is visible to consumers: the broker stamps when it
    # appends it. This test's own consumer, sharing two cores with the load generator,
    # would add lag of its own to its read times (they are reported beside).
    set_topic_config(kafka.bootstrap_servers, spec.output_topic,
                     {"message.timestamp.type": "LogAppendTime"})  # fmt: skip
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 1})
    collector = collector_for(deployment)
    world = sample_assets.world
    normal = itertools.repeat(1)
    phases: dict[str, Phase] = {}

    def run(phase: Phase, priorities=normal) -> None:
        phases[phase.name] = phase
        _run(producer, spec.input_topic, world, encoder, phase, priorities)
        collector.wait_for(1 + sum(len(p.priorities) for p in phases.values()), 60)

    try:
        with deployment.worker():
            # The worker is serving once it answers one event.
            produce_events(kafka.bootstrap_servers, spec.input_topic, world, 1, 0, "ready")
            assert len(collector.wait_for(1, 120)) == 1, deployment.log_tail()
            capacity = 0.0
            for rate in (RAMP_START_PER_S * 2**step for step in range(RAMP_STEPS)):
                step = Phase(f"ramp{rate:.0f}", rate, RAMP_STEP_S, {})
                run(step)
                ok = _ok_count(collector.snapshot().predictions, step)
                capacity = max(capacity, ok / step.seconds)
                if ok < 0.9 * len(step.priorities):
                    break
            else:
                pytest.fail(f"the heavy model kept up with {rate:.0f}/s: no capacity found")

            run(Phase("overload", 3 * capacity, 10.0, {}), itertools.cycle([HIGH, LOW]))
            run(Phase("calm", capacity / 2, 10.0, {}))
            sent = 1 + sum(len(p.priorities) for p in phases.values())
            outcomes = collector.wait_for(sent, 120)
            # The worker counts an outcome once Kafka confirms its write, which can come
            # a moment after a reader sees it.
            wait_until(lambda: sum(_outcomes_counted(_scrape(port)).values()) >= sent, 10)
            metrics = _scrape(port)
        collector.stop()
        audits = audit(config)
    finally:
        collector.stop()
        delete_topics(kafka.bootstrap_servers, created)
    answers = {p["event_id"]: p for p in outcomes.predictions}
    yield {
        "runtime": runtime,
        "capacity": capacity,
        "phases": phases,
        "answers": answers,
        "outcomes": outcomes,
        "sent": sent,
        "metrics": metrics,
        "audit": audits[0],
        "log": deployment.log_tail(),
    }


def _ok_count(predictions, phase: Phase) -> int:
    return sum(1 for p in predictions if p["event_id"] in phase.priorities and p["status"] == "OK")


def _of(run, phase_name: str, priority: int | None = None) -> list[dict]:
    phase = run["phases"][phase_name]
    return [
        run["answers"][event_id]
        for event_id, sent_with in phase.priorities.items()
        if event_id in run["answers"] and (priority is None or sent_with == priority)
    ]


def _ok_share(answers: list[dict]) -> float:
    return sum(1 for a in answers if a["status"] == "OK") / max(len(answers), 1)


def test_at_three_times_capacity_answers_in_full_meet_the_budget(overload):
    answers = _of(overload, "overload")
    ok = [a for a in answers if a["status"] == "OK"]
    statuses = {s: sum(1 for a in answers if a["status"] == s) for s in ("OK", "DEGRADED", "SHED")}
    p99_ms = float(np.percentile([a["visible_latency_ms"] for a in ok], 99))
    read_p99_ms = float(np.percentile([a["latency_ms"] for a in ok], 99))
    print(
        f"\ncapacity {overload['capacity']:.0f}/s; at 3x: {statuses}, "
        f"degraded+shed {1 - _ok_share(answers):.0%}, OK p99 {p99_ms:.0f} ms "
        f"(read by the test's consumer: {read_p99_ms:.0f} ms)"
    )
    assert len(answers) == len(overload["phases"]["overload"].priorities), overload["log"]
    assert statuses["DEGRADED"] + statuses["SHED"] > len(answers) / 3  # it was overloaded
    assert p99_ms <= BUDGET_MS


def test_every_input_has_exactly_one_outcome_and_the_counters_agree(overload):
    found = overload["audit"]
    assert (found.missing, found.duplicated) == (0, 0)
    assert format_report([found]).endswith("every committed input has exactly one outcome")
    assert found.inputs == overload["sent"]
    assert sum(found.outcomes.values()) == found.inputs
    assert _outcomes_counted(overload["metrics"]) == found.outcomes


def test_under_overload_high_priority_reaches_full_answers_first(overload):
    high = _ok_share(_of(overload, "overload", HIGH))
    low = _ok_share(_of(overload, "overload", LOW))
    print(f"\nOK share at 3x: high priority {high:.0%}, low priority {low:.0%}")
    assert high >= 2 * low
    assert high >= 0.2


def test_full_answers_return_within_seconds_when_load_drops(overload):
    calm = overload["phases"]["calm"]
    later = [
        a
        for a in _of(overload, "calm")
        if a["event_timestamp_ms"] / 1000 >= calm.started_s + RECOVERY_S
    ]
    print(f"\nOK share at half capacity after {RECOVERY_S:.0f} s: {_ok_share(later):.1%}")
    # What was not answered in full, and when: the first thing to look at when it fails.
    missed = sorted(
        (round(a["event_timestamp_ms"] / 1000 - calm.started_s, 2), a["status"], a["reason"])
        for a in later
        if a["status"] != "OK"
    )
    assert _ok_share(later) >= 0.95, (
        f"{len(missed)} of {len(later)} not OK: {Counter(m[1:] for m in missed)}; "
        f"(s into the calm, status, reason) first {missed[:5]}, last {missed[-5:]}"
    )


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_a_stale_backlog_is_shed_cheaply_and_fresh_events_are_served(
    deploy, kafka, sample_assets, runtime
):
    deployment = deploy(runtime=runtime, latency_budget_ms=BUDGET_MS)
    spec = deployment.spec
    backlog = produce_events(kafka.bootstrap_servers, spec.input_topic, sample_assets.world,
                             5_000, seed=21, prefix="stale")  # fmt: skip
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 1})
    collector = collector_for(deployment)
    try:
        # The backlog is seconds old when the worker starts: every deadline has passed.
        with deployment.worker():
            answered = collector.wait_for(len(backlog), 120)
            assert len(answered) == len(backlog), deployment.log_tail()
            # 8 s: one stall of the shared machine (250 ms seen once) is a few events.
            fresh = Phase("fresh", 50.0, 8.0, {})
            _run(producer, spec.input_topic, sample_assets.world, encoder, fresh,
                 itertools.repeat(1))  # fmt: skip
            outcomes = collector.wait_for(len(backlog) + len(fresh.priorities), 60)
    finally:
        collector.stop()
    stale = [p for p in outcomes.predictions if p["event_id"] in backlog]
    reads_s = sorted(p["latency_ms"] / 1000 + p["event_timestamp_ms"] / 1000 for p in stale)
    print(f"\n{runtime}: {len(stale)} stale events answered in {reads_s[-1] - reads_s[0]:.1f} s")
    assert {(p["status"], p["reason"]) for p in stale} == {("SHED", "deadline_passed")}
    # Shed without any feature or model work.
    assert all(p["timings"]["inference_us"] == 0 == p["timings"]["features_us"] for p in stale)
    served = [p for p in outcomes.predictions if p["event_id"] in fresh.priorities]
    print(
        Counter((p["status"], p["reason"]) for p in served),
        sorted(int(p["latency_ms"]) for p in served)[::10],
    )
    assert len(served) == len(fresh.priorities)
    assert _ok_share(served) >= 0.95
