"""Model lifecycle through a real broker and real ONNX Runtime: a deploy under a steady
stream, refused versions, a worker started after a deploy, canary and shadow, a guardrail
that rolls a slow canary back."""

from __future__ import annotations

import itertools
import re
import threading
from collections import defaultdict
from datetime import datetime

import pytest
import yaml
from confluent_kafka import Producer

from infra.ports import free_port
from infra.topics import delete_topics
from models.registry import FolderRegistry
from models.synthetic import write_heavy_model
from models.train_intent import intent_path
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroDecoder, AvroEncoder
from streams.control import desired_states, ensure_control_topics, worker_reports, write_desired
from streams.guardrail import Guardrail
from tests.conftest import Deployment
from tests.helpers import (
    PATIENT_BUDGET_MS,
    headrace,
    produce_events,
    scrape,
    total,
    wait_until,
)
from tools import rollout
from tools.audit import audit
from tools.collector import OutcomeCollector, TopicReader
from tools.deploy import write_config
from tools.loadgen import encoded, sample_events, send_at_rate

pytestmark = pytest.mark.integration


@pytest.fixture
def lifecycle(request, deploy, sample_assets, tmp_path):
    """A deployment (bare runtime, or the one a test parametrizes it with) whose model
    registry holds: 2 (the sample model again), 3 (a truncated file), 4 (a model with
    other inputs); its own control topics."""
    registry = FolderRegistry(tmp_path / "registry")
    model = sample_assets.model
    assert registry.register("fraud-mlp", model, {}) == "1"
    assert registry.register("fraud-mlp", model, {}) == "2"
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(model.read_bytes()[:2_000])
    assert registry.register("fraud-mlp", truncated, {}) == "3"
    assert registry.register("fraud-mlp", intent_path(model), {}) == "4"

    runtime = getattr(request, "param", "bare")
    deployment = deploy(runtime=runtime, latency_budget_ms=PATIENT_BUDGET_MS)
    raw = yaml.safe_load(deployment.config_file.read_text())
    suffix = deployment.spec.input_topic.removeprefix("transactions")
    raw["pipelines"][0]["model"]["registry"] = {"root": str(registry.root)}
    raw["control"] = {
        "topic": f"control{suffix}",
        "status_topic": f"control-status{suffix}",
        "heartbeat_interval_s": 1,
    }
    config = write_config(raw, deployment.config_file)
    yield Deployment(config, deployment.config_file, deployment.log_file)
    control = raw["control"]
    delete_topics(config.broker.bootstrap_servers, [control["topic"], control["status_topic"]])


def collector_for(deployment: Deployment) -> OutcomeCollector:
    spec = deployment.spec
    return OutcomeCollector(
        deployment.config.broker.bootstrap_servers, spec.output_topic, spec.dead_letter_topic,
        AvroDecoder(LocalCatalogue(), "prediction.avsc"),
    ).start()  # fmt: skip


def logged_at(log: str, text: str) -> datetime:
    """When the worker wrote the first line of `log` holding `text` (Faust's lines start
    with the time in brackets)."""
    line = next(line for line in log.splitlines() if text in line)
    stamp = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", line)
    assert stamp is not None, line
    return datetime.strptime(stamp[0], "%Y-%m-%d %H:%M:%S,%f")


def reported(deployment: Deployment, check) -> bool:
    return any(check(report) for report in worker_reports(deployment.config))


@pytest.mark.parametrize("lifecycle", ["bare", "faust"], indirect=True)
def test_deploy_switches_once_per_partition_refuses_broken_versions_and_persists(
    lifecycle, sample_assets
):
    config, spec = lifecycle.config, lifecycle.spec
    bootstrap = config.broker.bootstrap_servers
    collector = collector_for(lifecycle)
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    events = encoded(sample_events(sample_assets.world, 21, "steady"), encoder)
    producer = Producer({"bootstrap.servers": bootstrap})
    rate, seconds = 150, 12
    with lifecycle.worker():
        assert wait_until(lambda: reported(lifecycle, lambda r: r.serving == "1"), 60), (
            lifecycle.log_tail()
        )
        stream = threading.Thread(
            target=send_at_rate, args=(producer, spec.input_topic, events, rate, seconds)
        )
        stream.start()
        try:
            assert collector._reader.wait_for(300, 30) >= 300, lifecycle.log_tail()
            # As an operator runs it: the command waits until the worker applied it.
            deploy = ("models", "deploy", "-c", str(lifecycle.config_file), spec.name)
            done = headrace(*deploy, "2", "--wait", "30", cwd=lifecycle.config_file.parent)
            assert done.code == 0 and "serving v2, revision 1" in done.output, done.output
            assert reported(lifecycle, lambda r: r.serving == "2")
            # A truncated file and a model of other inputs: refused, v2 keeps serving.
            done = headrace(*deploy, "3", "--wait", "30", cwd=lifecycle.config_file.parent)
            assert done.code == 65, done.output
            assert "v3 refused by 1 of 1 workers" in done.lines[-1], done.output
            assert "hint: `headrace models rollback fraud`" in done.lines[-1], done.output
            rollout.deploy(config, spec, "4", "canary", 10)
            assert wait_until(
                lambda: reported(lifecycle, lambda r: {"3", "4"} <= set(r.refused)), 30
            ), lifecycle.log_tail()
            # The refused candidate's desired state undone; v3 stays desired (and refused).
            assert rollout.rollback(config, spec).candidate is None
        finally:
            stream.join()
        outcomes = collector.wait_for(rate * seconds, 60)
        status = "\n".join(rollout.status_lines(config, spec))
    assert "serving v2" in status and "refused v3" in status and "refused v4" in status, status

    answers = outcomes.predictions
    assert len(answers) == rate * seconds and not outcomes.dead_letters
    assert len({(a["input_partition"], a["input_offset"]) for a in answers}) == len(answers)
    assert all(a["status"] == "OK" for a in answers)
    by_partition = defaultdict(list)
    for answer in sorted(answers, key=lambda a: a["input_offset"]):
        by_partition[answer["input_partition"]].append(answer["model_version"])
    for partition, versions in by_partition.items():
        switches = sum(1 for a, b in itertools.pairwise(versions) if a != b)
        assert versions[0] == "1" and versions[-1] == "2" and switches == 1, (partition, versions)
    [report] = audit(config)
    assert report.exact, report.as_dict()

    # A worker started after the deploys answers with the version the group serves from
    # the first: v3 is desired, but refused, so v2, which that deploy replaced. Its control
    # topic holds only the latest desired state, as compaction leaves it (replaying the
    # whole history, a worker would meet v2's own deploy on its way).
    raw = yaml.safe_load(lifecycle.config_file.read_text())
    raw["control"]["topic"] = f"{config.control.topic}-compacted"
    compacted_file = lifecycle.config_file.with_name("compacted.yaml")
    compacted = write_config(raw, compacted_file)
    ensure_control_topics(compacted)
    write_desired(compacted, rollout.current(config, spec))
    later = collector_for(lifecycle)
    produce_events(bootstrap, spec.input_topic, sample_assets.world, 30, seed=22, prefix="late")
    with Deployment(compacted, compacted_file, lifecycle.log_file).worker():
        # Everything up to now, then the 30 new ones.
        fresh = [a for a in later.wait_for(rate * seconds + 30, 90).predictions
                 if a["event_id"].startswith("late")]  # fmt: skip
    assert len(fresh) == 30 and {a["model_version"] for a in fresh} == {"2"}
    assert rollout.rollback(config, spec).serving == "2"  # v3's deploy undone
    delete_topics(bootstrap, [compacted.control.topic])


@pytest.mark.parametrize("lifecycle", ["bare", "faust"], indirect=True)
def test_canary_is_sticky_per_key_and_shadow_writes_one_answer_per_input(lifecycle, sample_assets):
    config, spec = lifecycle.config, lifecycle.spec
    bootstrap = config.broker.bootstrap_servers
    collector = collector_for(lifecycle)
    decoder = AvroDecoder(LocalCatalogue(), "prediction.avsc")
    shadow_answers = []

    def keep(messages, _read_ms) -> int:
        shadow_answers.extend(decoder.decode(m.value()) for m in messages)
        return len(messages)

    shadow = TopicReader(bootstrap, [spec.shadow_output_topic], keep).start()
    with lifecycle.worker():
        n = 600
        produce_events(bootstrap, spec.input_topic, sample_assets.world, n, seed=31, prefix="a")
        baseline = collector.wait_for(n, 60).predictions
        rollout.deploy(config, spec, "2", "shadow")
        assert wait_until(lambda: reported(lifecycle, lambda r: r.mode == "shadow"), 30)
        produce_events(bootstrap, spec.input_topic, sample_assets.world, n, seed=31, prefix="a")
        shadowed = collector.wait_for(2 * n, 60).predictions[n:]
        assert shadow.wait_for(n, 30) == n, lifecycle.log_tail()

        rollout.deploy(config, spec, "2", "canary", 10)
        assert wait_until(lambda: reported(lifecycle, lambda r: r.mode == "canary"), 30)
        produce_events(bootstrap, spec.input_topic, sample_assets.world, n, seed=32, prefix="c")
        canary = collector.wait_for(3 * n, 60).predictions[2 * n :]
    shadow.stop()

    # Shadow: the serving answers are those of the run without it (timings aside).
    varying = ("timings", "input_offset", "event_timestamp_ms", "latency_ms", "visible_latency_ms",
               "produced_ms")  # fmt: skip

    def answers(run):
        return sorted(({k: v for k, v in a.items() if k not in varying} for a in run),
                      key=lambda a: a["event_id"])  # fmt: skip

    assert answers(shadowed) == answers(baseline)
    assert {a["model_version"] for a in shadowed} == {"1"}
    # One candidate answer per input, by the candidate.
    inputs = sorted((a["input_partition"], a["input_offset"]) for a in shadowed)
    assert sorted((a["input_partition"], a["input_offset"]) for a in shadow_answers) == inputs
    assert {a["model_version"] for a in shadow_answers} == {"2"}
    # Canary: a key is always on one side; about a tenth of the keys on the candidate's.
    side = defaultdict(set)
    for a in canary:
        side[a["key"]].add(a["model_version"])
    assert all(len(versions) == 1 for versions in side.values())
    share = sum(a["model_version"] == "2" for a in canary) / len(canary)
    assert 0.04 < share < 0.18, share


@pytest.mark.timeout(180)
@pytest.mark.parametrize("lifecycle", ["bare", "faust"], indirect=True)
def test_a_guardrail_rolls_a_slow_canary_back_within_its_window_and_serving_goes_on(
    lifecycle, sample_assets, tmp_path
):
    raw = yaml.safe_load(lifecycle.config_file.read_text())
    port = raw["metrics"]["port"] = free_port()
    config = write_config(raw, lifecycle.config_file)
    spec = config.pipelines[0]
    # ~64 MFLOP per event against the sample model's few thousand: over 5 ms for a batch
    # of one even on a fast core (the default width, 1 ms, can hide in a noisy p99).
    heavy = write_heavy_model(sample_assets.model, tmp_path / "heavy.onnx", width=2048)
    slow = FolderRegistry(spec.model.registry.root).register("fraud-mlp", heavy, {})
    collector = collector_for(lifecycle)
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    events = encoded(sample_events(sample_assets.world, 23, "steady"), encoder)
    producer = Producer({"bootstrap.servers": config.broker.bootstrap_servers})
    rate, seconds = 100, 10
    rule = Guardrail(window_s=10, max_p99_increase_ms=2)
    with lifecycle.worker():
        assert wait_until(lambda: reported(lifecycle, lambda r: r.serving == "1"), 60), (
            lifecycle.log_tail()
        )
        stream = threading.Thread(
            target=send_at_rate, args=(producer, spec.input_topic, events, rate, seconds)
        )
        stream.start()
        try:
            assert collector._reader.wait_for(100, 30) >= 100, lifecycle.log_tail()
            rollout.deploy(config, spec, slow, "canary", 50, rule)
            # The rollback may come before a heartbeat shows the candidate: wait for the
            # rollback itself, then time it from the worker's own log lines.
            assert wait_until(lambda: desired_states(config)[spec.name].candidate is None, 60), (
                lifecycle.log_tail()
            )
            assert wait_until(lambda: reported(lifecycle, lambda r: r.candidate is None), 30)
        finally:
            stream.join()
        outcomes = collector.wait_for(rate * seconds, 60)
        rollbacks = total(scrape(port), "headrace_model_rollbacks_total", reason="latency")
    desired = desired_states(config)[spec.name]
    assert desired.candidate is None and desired.serving is None
    assert desired.reason.startswith("guardrail: latency: p99"), desired.reason
    log = lifecycle.log_tail(400)
    assert rollbacks == 1 and log.count("broke its guardrail") == 1
    answering = logged_at(log, f"candidate v{slow} (canary 50%)")
    assert (logged_at(log, "broke its guardrail") - answering).total_seconds() < rule.window_s

    # Serving went on: every input answered once and OK, the last ones by the serving model.
    answers = outcomes.predictions
    assert len(answers) == rate * seconds and not outcomes.dead_letters
    assert len({(a["input_partition"], a["input_offset"]) for a in answers}) == len(answers)
    assert all(a["status"] == "OK" for a in answers)
    in_time = sorted(answers, key=lambda a: a["event_timestamp_ms"])
    versions = [a["model_version"] for a in in_time]
    assert slow in versions and versions[-50:] == ["1"] * 50
