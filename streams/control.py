"""The model control plane: each pipeline's desired deployment in a compacted topic,
followed by every worker of the group, and each worker's report of what it applied.

Records of `control.topic` are keyed `<app_id>/<pipeline>` and hold a `Desired` as JSON;
compaction keeps the latest per pipeline, so a worker that starts later reads the same
state. Records of `control.status_topic` are keyed `<app_id>/<pipeline>/<worker>` and
hold a `Report` (the heartbeat). Both topics have one partition: one order of changes.

`ControlFollower` is a daemon thread per worker: it reads the control topic from the
beginning, hands each change of its pipelines' desired state to `apply` (which may
block while a model loads: nothing on the hot path waits for it), and reports every
`heartbeat_interval_s`. Between polls it asks `guard` for rollbacks its guardrails
decided and writes them to the control topic like any deploy: one worker's rollback is
enough, every worker (itself too) applies it when it reads it back. Every Kafka call
has a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from infra.kafka_clients import client_settings
from infra.topics import ensure_topics
from streams.config import HeadraceConfig
from streams.errors import ConfigError
from streams.guardrail import Guardrail

log = logging.getLogger(__name__)

Mode = Literal["canary", "shadow"]
_COMPACTED = {"cleanup.policy": "compact"}


@dataclass(frozen=True)
class Desired:
    """What a pipeline should serve. `serving` None: the model of the worker's config."""

    pipeline: str
    serving: str | None = None
    candidate: str | None = None
    mode: Mode | None = None
    canary_percent: float = 0.0
    previous: str | None = None
    """What `rollback` returns to when there is no candidate."""
    revision: int = 0
    reason: str = ""
    """Why it last changed: `deploy`, `promote`, `rollback`, `guardrail: ...`."""
    guardrail: Guardrail | None = None
    """The candidate's rule (`streams/guardrail.py`); None: only a person rolls it back."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Desired:
        fields = json.loads(raw)
        rule = fields.pop("guardrail", None)
        return cls(**fields, guardrail=Guardrail(**rule) if rule else None)

    def deploy(
        self, version: str, mode: Mode | None, percent: float, guardrail: Guardrail | None = None
    ) -> Desired:
        changed = dict(revision=self.revision + 1, reason="deploy")
        if mode is None:
            return replace(self, serving=version, previous=self.serving, candidate=None,
                           mode=None, canary_percent=0.0, guardrail=None, **changed)  # fmt: skip
        return replace(self, candidate=version, mode=mode, canary_percent=percent,
                       guardrail=guardrail, **changed)  # fmt: skip

    def promote(self) -> Desired:
        if self.candidate is None:
            raise ConfigError(f"pipeline {self.pipeline}: no candidate to promote")
        return replace(self, serving=self.candidate, previous=self.serving, candidate=None,
                       mode=None, canary_percent=0.0, guardrail=None,
                       revision=self.revision + 1, reason="promote")  # fmt: skip

    def rollback(self, reason: str = "rollback") -> Desired:
        """The candidate dropped; without one, the previous serving version back."""
        if self.candidate is not None:
            return replace(self, candidate=None, mode=None, canary_percent=0.0, guardrail=None,
                           revision=self.revision + 1, reason=reason)  # fmt: skip
        if self.serving is None:
            raise ConfigError(f"pipeline {self.pipeline}: nothing deployed to roll back")
        return replace(self, serving=self.previous, previous=None, revision=self.revision + 1,
                       reason=reason)  # fmt: skip


@dataclass(frozen=True)
class Report:
    """A worker's heartbeat for one pipeline: what it serves, and what it refused."""

    worker: str
    pipeline: str
    serving: str
    """The version answering (the config's model included)."""
    candidate: str | None = None
    mode: Mode | None = None
    canary_percent: float = 0.0
    revision: int = 0
    """The revision of the desired state it last acted on."""
    refused: dict[str, str] = field(default_factory=dict)
    """Version -> why it was refused (could not load, did not validate)."""
    sent_ms: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Report:
        return cls(**json.loads(raw))


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def ensure_control_topics(config: HeadraceConfig) -> None:
    control = config.control
    wanted = {control.topic: 1, control.status_topic: 1}
    ensure_topics(config.broker.bootstrap_servers, wanted, config.broker.connect_timeout_s,
                  _COMPACTED)  # fmt: skip


def _consumer(config: HeadraceConfig, topic: str) -> Consumer:
    broker = config.broker
    consumer = Consumer({
        **client_settings(broker.bootstrap_servers, "control", broker.connect_timeout_s),
        # Read by assignment, never committed: the group id is only required.
        "group.id": f"{config.app_id}.control",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
    })  # fmt: skip
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    return consumer


def read_table(config: HeadraceConfig, topic: str, timeout_s: float = 10.0) -> dict[str, bytes]:
    """The latest value of each key of this app in a compacted topic, read to its end
    ({} while the topic does not exist: no worker made it yet)."""
    consumer = _consumer(config, topic)
    metadata = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if metadata is None or metadata.error is not None:
        consumer.close()
        return {}
    prefix = f"{config.app_id}/"
    table: dict[str, bytes] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            message = consumer.poll(min(1.0, max(0.0, deadline - time.monotonic())))
            if message is None:
                continue
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    return table
                continue
            key = (message.key() or b"").decode()
            if key.startswith(prefix):
                table[key[len(prefix) :]] = message.value()
    finally:
        consumer.close()
    raise ConfigError(f"topic {topic!r} could not be read to its end within {timeout_s:g} s")


def desired_states(config: HeadraceConfig, timeout_s: float = 10.0) -> dict[str, Desired]:
    table = read_table(config, config.control.topic, timeout_s)
    return {name: Desired.from_json(value) for name, value in table.items() if value}


def worker_reports(config: HeadraceConfig, timeout_s: float = 10.0) -> list[Report]:
    table = read_table(config, config.control.status_topic, timeout_s)
    return [Report.from_json(value) for value in table.values() if value]


def write_desired(config: HeadraceConfig, desired: Desired, timeout_s: float = 10.0) -> None:
    _write(config, config.control.topic, f"{desired.pipeline}", desired.to_json(), timeout_s)


def _write(config: HeadraceConfig, topic: str, key: str, value: bytes, timeout_s: float) -> None:
    broker = config.broker
    producer = Producer(client_settings(broker.bootstrap_servers, "control", timeout_s))
    failures: list[str] = []
    producer.produce(topic, value, f"{config.app_id}/{key}".encode(),
                     on_delivery=lambda err, _: err and failures.append(err.str()))  # fmt: skip
    left = producer.flush(timeout_s)
    if left or failures:
        raise ConfigError(f"could not write to {topic!r}: {failures or 'timed out'}")


class ControlFollower:
    """Follows the desired deployments of `pipelines` on a daemon thread and reports
    what `applied()` says every heartbeat. `start()`, `stop()` (safe twice)."""

    def __init__(
        self,
        config: HeadraceConfig,
        pipelines: Iterable[str],
        apply: Callable[[Desired], None],
        applied: Callable[[], list[Report]],
        guard: Callable[[], list[Desired]] = list,
    ) -> None:
        self._config = config
        self._pipelines = set(pipelines)
        self._apply = apply
        self._applied = applied
        self._guard = guard
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[str, Desired] = {}
        broker = config.broker
        self._producer = Producer({
            **client_settings(broker.bootstrap_servers, "control", broker.connect_timeout_s),
            "linger.ms": 0,
        })  # fmt: skip

    def catch_up(self, timeout_s: float = 10.0) -> None:
        """Apply the desired state as it stands now (blocks while versions load)."""
        for name, desired in desired_states(self._config, timeout_s).items():
            self._follow(name, desired)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="control", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._producer.flush(5)

    def heartbeat(self) -> None:
        for report in self._applied():
            report = replace(report, sent_ms=int(time.time() * 1000))
            key = f"{self._config.app_id}/{report.pipeline}/{report.worker}"
            self._producer.produce(self._config.control.status_topic, report.to_json(), key)
        self._producer.poll(0)

    def _write_rollbacks(self) -> None:
        rollbacks = self._guard()
        for desired in rollbacks:
            key = f"{self._config.app_id}/{desired.pipeline}"
            self._producer.produce(self._config.control.topic, desired.to_json(), key)
        timeout_s = self._config.broker.connect_timeout_s
        if rollbacks and self._producer.flush(timeout_s):
            log.error("a guardrail's rollback was not written within %g s (still queued)",
                      timeout_s)  # fmt: skip

    def _follow(self, name: str, desired: Desired) -> None:
        if name not in self._pipelines or self._seen.get(name) == desired:
            return
        self._seen[name] = desired
        try:
            self._apply(desired)
        except Exception:  # a bug in applying must not end the follower: traffic stays
            log.exception("pipeline %s: applying deployment %s failed", name, desired)
        self.heartbeat()  # report a change at once

    def _run(self) -> None:
        consumer = _consumer(self._config, self._config.control.topic)
        prefix = f"{self._config.app_id}/"
        interval_s = self._config.control.heartbeat_interval_s
        next_beat = 0.0
        try:
            while not self._stopping.is_set():
                if time.monotonic() >= next_beat:
                    self.heartbeat()
                    next_beat = time.monotonic() + interval_s
                self._write_rollbacks()
                message = consumer.poll(min(0.5, interval_s))
                if message is None or message.error():
                    continue
                key = (message.key() or b"").decode()
                if key.startswith(prefix) and message.value():
                    self._follow(key[len(prefix) :], Desired.from_json(message.value()))
        except Exception:
            log.exception("the model control follower stopped; deployments are not followed")
        finally:
            consumer.close()
