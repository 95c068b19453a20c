"""A schema-registry outage on both runtimes, with a registry of this module's own (so
stopping it hurts no other test): an event whose writer schema the worker has not met
stalls only its partition while the others keep being answered; the worker never
exits, dead-letters nothing for the registry's fault, and the stalled partition flows
again, in order, once the registry is back. A worker stopped during the outage stops
at once and leaves the held events to the next one."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from infra.ports import free_port
from infra.registry import SchemaRegistryServer
from schemas.catalogue import RegistryCatalogue, load_schema
from schemas.codec import AvroDecoder, AvroEncoder
from tests.chaos.conftest import input_offsets, outcomes_per_input, produce_in_order
from tests.chaos.test_poison import audited
from tests.helpers import wait_until
from tests.streams.test_worker import offline_scores
from tools.collector import OutcomeCollector
from tools.deploy import start_worker, stop_worker
from tools.loadgen import sample_events

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_registry(tmp_path_factory) -> Iterator[SchemaRegistryServer]:
    server = SchemaRegistryServer(tmp_path_factory.mktemp("own-registry"), free_port(), free_port())
    yield server
    server.stop()


def evolved_schema() -> dict:
    """The next version of the events' schema: a field more, with a default."""
    schema = load_schema("transaction.avsc")
    channel = {"name": "channel", "type": ["null", "string"], "default": None}
    return {**schema, "fields": [*schema["fields"], channel]}


def stalled_partitions(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "headrace_registry_stalled_partitions"
    )


class Outage:
    """A deployment against `registry`, its events framed through it (two versions of
    the input schema), and a reader of its answers."""

    def __init__(self, chaos_deploy, kafka, sample_assets, registry, runtime: str) -> None:
        registry.start()
        self.registry = registry
        self.metrics_port = free_port()
        self.deployment = chaos_deploy(
            runtime, registry_url=registry.url, metrics_port=self.metrics_port
        )
        spec = self.deployment.spec
        self.bootstrap = kafka.bootstrap_servers
        self.topic = spec.input_topic
        # As a producer would: each version registered under the topic's subject.
        catalogue = RegistryCatalogue(registry.url, timeout_s=10)
        subject = f"{self.topic}-value"
        self.v1 = AvroEncoder(catalogue, "transaction.avsc", subject)
        self.v2 = AvroEncoder(catalogue, evolved_schema(), subject)
        assert self.v1.schema_id != self.v2.schema_id
        self.events = sample_events(sample_assets.world, seed=41, prefix=f"outage-{runtime}")
        self.sent: dict[str, dict] = {}  # by event id
        self.collector = OutcomeCollector(
            self.bootstrap, spec.output_topic, spec.dead_letter_topic,
            AvroDecoder(RegistryCatalogue(registry.url, timeout_s=10), "prediction.avsc"),
        ).start()  # fmt: skip

    def send(self, partition: int, count: int, new_schema: bool = False) -> list[int]:
        encoder = self.v2 if new_schema else self.v1
        extra = {"channel": "app"} if new_schema else {}
        values = []
        for _ in range(count):
            event = {**next(self.events), **extra}
            self.sent[event["event_id"]] = event
            # One key per partition: its answers keep their order on the output topic.
            values.append((b"p%d" % partition, encoder.encode(event)))
        return produce_in_order(self.bootstrap, self.topic, values, partition)

    def answered(self, partition: int) -> list[int]:
        """Input offsets of `partition` answered so far, in the order answered."""
        return [
            a["input_offset"]
            for a in self.collector.snapshot().predictions
            if a["input_partition"] == partition
        ]

    def log(self) -> str:
        return self.deployment.log_file.read_text(errors="replace")


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_a_new_id_during_an_outage_stalls_only_its_partition(
    chaos_deploy, kafka, sample_assets, own_registry, runtime
):
    outage = Outage(chaos_deploy, kafka, sample_assets, own_registry, runtime)
    deployment = outage.deployment
    try:
        with deployment.worker() as worker:
            for partition in range(3):
                outage.send(partition, 10)
            assert wait_until(lambda: all(len(outage.answered(p)) == 10 for p in range(3)), 180), (
                deployment.log_tail()
            )
            own_registry.stop()
            stopped = time.monotonic()
            # Partition 2 meets the new version's id: it and what follows it wait.
            held = outage.send(2, 5, new_schema=True) + outage.send(2, 5)
            for round_ in (1, 2):
                for partition in (0, 1):
                    outage.send(partition, 10)
                assert wait_until(
                    lambda round_=round_: all(
                        len(outage.answered(p)) == 10 + 10 * round_ for p in (0, 1)
                    ), 60,
                ), deployment.log_tail()  # fmt: skip
                if round_ == 1:  # and again once the stall is known (and it is paused)
                    assert wait_until(lambda: "stalled" in outage.log(), 60), deployment.log_tail()
                    stalled_after_s = time.monotonic() - stopped
                    assert stalled_partitions(outage.metrics_port) == 1
                    held += outage.send(2, 5)
            assert len(outage.answered(2)) == 10
            assert worker.poll() is None, deployment.log_tail()
            own_registry.start()
            back = time.monotonic()
            assert wait_until(lambda: len(outage.answered(2)) == 25, 120), deployment.log_tail()
            resumed_after_s = time.monotonic() - back
            assert outage.answered(2)[10:] == held  # in order
            assert "flows again" in outage.log()
            assert wait_until(lambda: stalled_partitions(outage.metrics_port) == 0, 10)
            # Resumed at its consumer: what comes next is fetched and answered too.
            after = outage.send(2, 5)
            assert wait_until(lambda: outage.answered(2)[25:] == after, 60), deployment.log_tail()
            assert worker.poll() is None, deployment.log_tail()
        outcomes = outage.collector.snapshot()
    finally:
        outage.collector.stop()
        own_registry.start()
    print(f"{runtime}: stalled {stalled_after_s:.1f} s after the registry stopped, "
          f"flowing {resumed_after_s:.1f} s after it was back")  # fmt: skip
    inputs = input_offsets(outage.bootstrap, outage.topic)
    counts = outcomes_per_input(outcomes, outage.topic)
    assert set(counts) == inputs and set(counts.values()) == {1}
    assert outcomes.dead_letters == []
    assert {a["status"] for a in outcomes.predictions} == {"OK"}
    assert "giving up" not in outage.log() and "Traceback" not in outage.log()
    audited(deployment, len(inputs))
    # Decoded through the registry across its restart, both versions: the model's
    # answers are those of the same events scored offline.
    events = [outage.sent[answer["event_id"]] for answer in outcomes.predictions]
    offline = offline_scores(sample_assets.repo, deployment.spec, sample_assets.model, events)
    served = np.array([answer["score"] for answer in outcomes.predictions], dtype=np.float32)
    np.testing.assert_allclose(served, offline, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_a_worker_stopped_during_an_outage_stops_and_leaves_the_held_events_to_the_next(
    chaos_deploy, kafka, sample_assets, own_registry, runtime
):
    outage = Outage(chaos_deploy, kafka, sample_assets, own_registry, runtime)
    deployment = outage.deployment
    try:
        with deployment.worker():
            outage.send(0, 5)
            assert wait_until(lambda: len(outage.answered(0)) == 5, 180), deployment.log_tail()
            own_registry.stop()
            held = outage.send(1, 3, new_schema=True) + outage.send(1, 2)
            outage.send(0, 5)
            assert wait_until(lambda: "stalled" in outage.log(), 60), deployment.log_tail()
            assert wait_until(lambda: len(outage.answered(0)) == 10, 60), deployment.log_tail()
            stopping = time.monotonic()
        # The stop waited for no registry (and exited 0: `worker()` checks).
        stop_s = time.monotonic() - stopping
        print(f"{runtime}: stopped in {stop_s:.1f} s during the outage")
        assert stop_s < 30
        assert outage.answered(1) == []
        own_registry.start()
        with deployment.worker():
            assert wait_until(lambda: outage.answered(1) == held, 180), deployment.log_tail()
        outcomes = outage.collector.snapshot()
    finally:
        outage.collector.stop()
        own_registry.start()
    inputs = input_offsets(outage.bootstrap, outage.topic)
    counts = outcomes_per_input(outcomes, outage.topic)
    assert set(counts) == inputs and set(counts.values()) == {1}
    assert outcomes.dead_letters == []
    audited(deployment, len(inputs))


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_partitions_stalled_for_the_registry_move_to_a_new_worker(
    chaos_deploy, kafka, sample_assets, own_registry, runtime
):
    """A second worker joins during the outage: the first gives up what it held of the
    partitions that move (it neither waits for the registry nor exits), the second
    starts without the registry (it knows its answers' id) and stalls on them in turn;
    once the registry is back, every event is answered once."""
    outage = Outage(chaos_deploy, kafka, sample_assets, own_registry, runtime)
    deployment = outage.deployment
    second_log = deployment.log_file.with_name(f"second-{deployment.log_file.name}")
    # Beside the first's (the same known-schemas file), without a metrics port.
    second_config = deployment.config_file.with_name(f"second-{deployment.config_file.name}")
    raw = yaml.safe_load(deployment.config_file.read_text())
    second_config.write_text(yaml.safe_dump({**raw, "metrics": {"port": 0}}))
    second = None
    try:
        with deployment.worker() as first:
            for partition in range(3):
                outage.send(partition, 5)
            assert wait_until(
                lambda: all(len(outage.answered(p)) == 5 for p in range(3)), 180
            ), deployment.log_tail()  # fmt: skip
            own_registry.stop()
            held = {p: outage.send(p, 3, new_schema=True) + outage.send(p, 2) for p in range(3)}
            assert wait_until(lambda: stalled_partitions(outage.metrics_port) == 3, 60), (
                deployment.log_tail()
            )
            second = start_worker(second_config, second_log)
            assert wait_until(
                lambda: "stalled" in second_log.read_text(errors="replace"), 180
            ), second_log.read_text(errors="replace")[-3000:]  # fmt: skip
            assert "to be read again" in outage.log()  # the first gave up what moved
            assert first.poll() is None and second.poll() is None
            own_registry.start()
            assert wait_until(
                lambda: all(outage.answered(p)[5:] == held[p] for p in range(3)), 120
            ), deployment.log_tail()  # fmt: skip
            assert first.poll() is None and second.poll() is None
            assert stop_worker(second) == 0, second_log.read_text(errors="replace")[-3000:]
            second = None
        outcomes = outage.collector.snapshot()
    finally:
        if second is not None:
            stop_worker(second)
        outage.collector.stop()
        own_registry.start()
    inputs = input_offsets(outage.bootstrap, outage.topic)
    counts = outcomes_per_input(outcomes, outage.topic)
    assert set(counts) == inputs and set(counts.values()) == {1}
    assert outcomes.dead_letters == []
    audited(deployment, len(inputs))
