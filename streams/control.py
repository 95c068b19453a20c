"""The model control plane: each pipeline's desired deployment in a compacted topic,
followed by every worker of the group, and each worker's report of what it applied.

Records of `control.topic` are keyed `<app_id>/<pipeline>` and hold a `Desired` as JSON;
compaction keeps the latest per pipeline, so a worker that starts later reads the same
state. Records of `control.status_topic` are keyed `<app_id>/<pipeline>/<worker>` and
hold a `Report` (the heartbeat). Both topics have one partition: one order of changes.

`ControlFollower` is a daemon thread per worker: it reads the control topic from where
`catch_up` ended, hands each change of its pipelines' desired state to `apply` (which may
block while a model loads: nothing on the hot path waits for it), and reports every
`heartbeat_interval_s`. Between polls it asks `guard` for rollbacks its guardrails
decided and writes them to the control topic as a command writes a deploy
(`write_rollback`): one worker's rollback is enough, every worker (itself too) applies it
when it reads it back. A rollback whose write fails is written again (with a growing
pause) until Kafka confirms it or a newer revision of its pipeline makes it obsolete.
Every Kafka call has a timeout. A desired state older than one already seen (by revision) is
ignored, and a record that does not parse is logged and skipped: neither ends the follower.

Revisions count within one incarnation of the control topic: an operator who deletes and
recreates it starts them again from 1. The follower checks the topic's id every heartbeat;
when it changes, it reads the new topic from its start and follows that (what it saw of
the old one no longer holds newer revisions back).

`change_desired` writes a change of a pipeline's desired state (`headrace models deploy`,
and a guardrail's rollback) so that two at once cannot both build on the same revision:
see its docstring.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from infra.kafka_clients import client_settings
from infra.topics import ensure_topics
from schemas.errors import HeadraceError
from streams.config import HeadraceConfig
from streams.errors import ConfigError
from streams.guardrail import Guardrail

log = logging.getLogger(__name__)

Mode = Literal["canary", "shadow"]
_COMPACTED = {"cleanup.policy": "compact"}
T = TypeVar("T")

# A guardrail's rollback that Kafka did not take is written again after this pause,
# doubled at each failure up to the cap: a broker away is not hammered, one back soon is
# not waited for long.
ROLLBACK_RETRY_S = 0.5
ROLLBACK_RETRY_MAX_S = 30.0
# How long the follower's producer keeps a heartbeat before giving it up (librdkafka's
# default, 5 min: heartbeats that old are useless).
_DELIVERY_TIMEOUT_MS = 30_000


class ConcurrentChange(HeadraceError):
    """Another command changed the same pipeline's desired state at the same time; this
    change was not written."""

    exit_status = 75  # EX_TEMPFAIL: run it again


def _known(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` without the keys `cls` does not have (written by a newer CLI, say); each
    such set of keys is logged once (the topics are read again and again)."""
    names = {f.name for f in fields(cls)}
    unknown = tuple(sorted(set(raw) - names))
    if unknown and (cls.__name__, unknown) not in _WARNED:
        _WARNED.add((cls.__name__, unknown))
        log.warning("%s: ignoring unknown fields %s", cls.__name__, list(unknown))
    return {k: v for k, v in raw.items() if k in names}


_WARNED: set[tuple[str, tuple[str, ...]]] = set()


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
        """Raises (ValueError, TypeError, ConfigError...) on a record that is not one."""
        known = _known(cls, json.loads(raw))
        rule = known.pop("guardrail", None)
        return cls(**known, guardrail=Guardrail(**_known(Guardrail, rule)) if rule else None)

    def deploy(
        self, version: str, mode: Mode | None, percent: float, guardrail: Guardrail | None = None
    ) -> Desired:
        changed = dict(revision=self.revision + 1, reason="deploy")
        if mode is None:
            # The version served again: what a rollback returns to stays the same.
            previous = self.previous if version == self.serving else self.serving
            return replace(self, serving=version, previous=previous, candidate=None,
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


@dataclass
class _PendingRollback:
    """A guardrail's rollback until Kafka confirms it written (or it is obsolete)."""

    desired: Desired
    due_s: float = 0.0
    """When (the follower's clock) to write it next."""
    failures: int = 0


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
        return cls(**_known(cls, json.loads(raw)))


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def ensure_control_topics(config: HeadraceConfig) -> list[str]:
    """Create the control topics that do not exist yet; return the names created."""
    control = config.control
    wanted = {control.topic: 1, control.status_topic: 1}
    broker = config.broker
    return ensure_topics(broker.bootstrap_servers, wanted, broker.connect_timeout_s, _COMPACTED)


def _consumer(config: HeadraceConfig, topic: str, offset: int = OFFSET_BEGINNING) -> Consumer:
    broker = config.broker
    consumer = Consumer({
        **client_settings(broker.bootstrap_servers, "control", broker.connect_timeout_s),
        # Read by assignment, never committed: the group id is only required.
        "group.id": f"{config.app_id}.control",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        # librdkafka's default, named because `change_desired` writes in transactions:
        # a change is read once committed, never one that was fenced and aborted.
        "isolation.level": "read_committed",
    })  # fmt: skip
    consumer.assign([TopicPartition(topic, 0, offset)])
    return consumer


def _parse(parse: Callable[[bytes], T], topic: str, offset: int, raw: bytes) -> T | None:
    """`parse(raw)`, or None (logged) when the record is not one: a bad record is skipped."""
    try:
        return parse(raw)
    except Exception as exc:  # whatever its shape: one bad record must not stop the reader
        log.warning("%s offset %d: record skipped, it does not parse: %s", topic, offset, exc)
        return None


def read_latest(
    config: HeadraceConfig, topic: str, parse: Callable[[bytes], T], timeout_s: float = 10.0
) -> tuple[dict[str, T], int]:
    """The latest value that parses of each key of this app in a compacted topic, read
    to its end, and the offset after it ({} while the topic does not exist: no worker
    made it yet). Records that do not parse are logged and skipped."""
    consumer = _consumer(config, topic)
    metadata = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if metadata is None or metadata.error is not None:
        consumer.close()
        return {}, OFFSET_BEGINNING
    prefix = f"{config.app_id}/"
    table: dict[str, T] = {}
    end = OFFSET_BEGINNING  # nothing read: a follower starting there misses nothing
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            message = consumer.poll(min(1.0, max(0.0, deadline - time.monotonic())))
            if message is None:
                continue
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    return table, end
                continue
            end = message.offset() + 1
            key = (message.key() or b"").decode()
            if not key.startswith(prefix):
                continue
            if not message.value():  # a tombstone
                table.pop(key[len(prefix) :], None)
            elif (value := _parse(parse, topic, message.offset(), message.value())) is not None:
                table[key[len(prefix) :]] = value
    finally:
        consumer.close()
    raise ConfigError(f"topic {topic!r} could not be read to its end within {timeout_s:g} s")


def desired_states(config: HeadraceConfig, timeout_s: float = 10.0) -> dict[str, Desired]:
    return read_latest(config, config.control.topic, Desired.from_json, timeout_s)[0]


def worker_reports(config: HeadraceConfig, timeout_s: float = 10.0) -> list[Report]:
    return list(
        read_latest(config, config.control.status_topic, Report.from_json, timeout_s)[0].values()
    )


def write_desired(config: HeadraceConfig, desired: Desired, timeout_s: float = 10.0) -> None:
    """Write `desired` to the control topic, creating the control topics first: a deploy
    may come before any worker made them, and a broker without topic auto-creation would
    hold the record until the write timed out."""
    ensure_control_topics(config)
    _write(config, config.control.topic, f"{desired.pipeline}", desired.to_json(), timeout_s)


def change_desired(
    config: HeadraceConfig,
    pipeline: str,
    change: Callable[[], Desired],
    timeout_s: float = 10.0,
) -> Desired:
    """Write the desired state `change()` returns (it reads the current one and builds on
    it) so that a concurrent change of the same pipeline is never silently lost: one of
    two overlapping commands raises ConcurrentChange and writes nothing. Blocks up to a
    few `timeout_s`; ConfigError when Kafka does not take the write.

    How: the write is a Kafka transaction whose transactional.id names the pipeline.
    `init_transactions` fences every earlier producer with that id (its open transaction
    is aborted, its commit fails), and `change()` runs after it, so it reads every change
    committed before; a command that read, then was overtaken, cannot commit. Followers
    read committed records only (`_consumer`)."""
    ensure_control_topics(config)
    topic = config.control.topic
    broker = config.broker
    producer = Producer({
        **client_settings(broker.bootstrap_servers, "control", timeout_s),
        "transactional.id": f"{topic}:{config.app_id}/{pipeline}",
        # An open transaction holds back every reader of the topic: one left by a
        # command killed before it committed is aborted after this.
        "transaction.timeout.ms": int(2 * timeout_s * 1000),
    })  # fmt: skip
    try:
        producer.init_transactions(timeout_s)
        desired = change()
        producer.begin_transaction()
        producer.produce(topic, desired.to_json(), f"{config.app_id}/{pipeline}".encode())
        producer.commit_transaction(timeout_s)
    except KafkaException as exc:
        error = exc.args[0]
        if error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                            KafkaError.INVALID_PRODUCER_EPOCH):  # fmt: skip
            raise ConcurrentChange(
                f"pipeline {pipeline}: another command changed its desired state while this "
                "one did; this change was not written; hint: see `headrace models status "
                f"{pipeline}`, then run the command again"
            ) from exc
        if error.txn_requires_abort():
            with contextlib.suppress(KafkaException):  # not committed either way
                producer.abort_transaction(timeout_s)
        raise ConfigError(
            f"pipeline {pipeline}: could not write to {topic!r}: {error.str()}; hint: is "
            "the broker running? `headrace models status` shows what is desired"
        ) from exc
    return desired


class Overtaken(Exception):
    """A guardrail's rollback was not written: its pipeline is no longer at the revision
    the rollback was built from."""

    def __init__(self, latest: Desired | None) -> None:
        super().__init__(
            "the control topic holds no state for it (recreated?)" if latest is None
            else f"it is at revision {latest.revision} now"
        )  # fmt: skip
        self.latest = latest


def write_rollback(config: HeadraceConfig, rollback: Desired, timeout_s: float) -> None:
    """Write a guardrail's rollback as a command writes its change (`change_desired`),
    only while the pipeline is still at the revision it was built from; Overtaken if
    not. A plain write could land after a command's change made in the meantime, and
    undo it (the command said done, the workers then followed the rollback), or land
    in a control topic recreated since (a rollback of a deploy it no longer holds)."""

    def unless_overtaken() -> Desired:
        latest = desired_states(config, timeout_s).get(rollback.pipeline)
        if latest is None or latest.revision != rollback.revision - 1:
            raise Overtaken(latest)
        return rollback

    change_desired(config, rollback.pipeline, unless_overtaken, timeout_s)


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._pipelines = set(pipelines)
        self._apply = apply
        self._applied = applied
        self._guard = guard
        self._clock = clock
        self._rollbacks: dict[str, _PendingRollback] = {}
        """Per pipeline, the guardrail's rollback not yet confirmed written."""
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[str, Desired] = {}
        self._offset = OFFSET_BEGINNING
        """Where the follower starts reading: where `catch_up` ended."""
        self._topic_id: str | None = None
        """The id of the control topic's incarnation read (None: it did not exist yet)."""
        broker = config.broker
        self._producer = Producer({
            **client_settings(broker.bootstrap_servers, "control", broker.connect_timeout_s),
            "linger.ms": 0,
            "message.timeout.ms": _DELIVERY_TIMEOUT_MS,
        })  # fmt: skip
        self._admin = AdminClient(
            client_settings(broker.bootstrap_servers, "control", broker.connect_timeout_s)
        )

    def catch_up(self, timeout_s: float = 10.0) -> None:
        """Apply the desired state as it stands now (blocks while versions load)."""
        # The id first: a topic recreated while it is read shows as a change later.
        self._topic_id = self._answered_topic_id(self._ask_topic_id(), timeout_s)
        topic = self._config.control.topic
        states, self._offset = read_latest(self._config, topic, Desired.from_json, timeout_s)
        for name, desired in states.items():
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
        """Write the rollbacks the guardrails decided, and again those whose write failed
        when their pause is over. A write takes a second or two (a transaction), during
        which this thread neither follows nor reports: rollbacks are rare, and nothing
        else the worker does waits for this thread."""
        for desired in self._guard():
            waiting = self._rollbacks.get(desired.pipeline)
            newer = waiting is None or desired.revision > waiting.desired.revision
            if newer and self._current(desired):
                self._rollbacks[desired.pipeline] = _PendingRollback(desired)
        now = self._clock()
        for name, pending in list(self._rollbacks.items()):
            seen = self._seen.get(name)
            if seen is not None and seen.revision >= pending.desired.revision:
                # Read back (this write or another worker's), or overtaken by a newer change.
                if pending.failures:
                    log.warning("pipeline %s: the guardrail's rollback to revision %d is no "
                                "longer written, revision %d was read", name,
                                pending.desired.revision, seen.revision)  # fmt: skip
                del self._rollbacks[name]
            elif now >= pending.due_s:
                self._write_rollback(pending)

    def _write_rollback(self, pending: _PendingRollback) -> None:
        name, revision = pending.desired.pipeline, pending.desired.revision
        timeout_s = self._config.broker.connect_timeout_s
        try:
            write_rollback(self._config, pending.desired, timeout_s)
        except Overtaken as exc:
            if exc.latest != pending.desired:  # else an attempt that seemed to fail was written
                log.warning("pipeline %s: the guardrail's rollback to revision %d not written: "
                            "%s", name, revision, exc)  # fmt: skip
            del self._rollbacks[name]
            return
        except Exception as exc:  # any failure (Kafka away, another writer): retried
            pending.failures += 1
            pause_s = min(ROLLBACK_RETRY_MAX_S, ROLLBACK_RETRY_S * 2 ** (pending.failures - 1))
            pending.due_s = self._clock() + pause_s
            if pending.failures == 1:  # once per failure: retries until written say nothing
                log.error("pipeline %s: the guardrail's rollback to revision %d could not be "
                          "written (%s); the candidate serves until it is: retrying",
                          name, revision, exc)  # fmt: skip
            return
        del self._rollbacks[name]
        if pending.failures:
            log.warning("pipeline %s: the guardrail's rollback to revision %d written after "
                        "%d failed attempts", name, revision, pending.failures)  # fmt: skip

    def _current(self, rollback: Desired) -> bool:
        """Whether a guardrail's rollback was built from the latest revision seen: one
        built from an older one would undo the deploys since."""
        seen = self._seen.get(rollback.pipeline)
        if seen is not None and rollback.revision <= seen.revision:
            log.warning(
                "pipeline %s: a rollback of revision %d not written, revision %d is newer",
                rollback.pipeline, rollback.revision - 1, seen.revision,
            )  # fmt: skip
            return False
        return True

    def _follow(self, name: str, desired: Desired) -> None:
        if name not in self._pipelines:
            return
        seen = self._seen.get(name)
        # Older revisions are history, not changes. The same revision written twice (two
        # writers at once) is followed when it differs: compaction keeps the later one.
        if seen is not None and (desired.revision < seen.revision or desired == seen):
            return
        self._seen[name] = desired
        try:
            self._apply(desired)
        except Exception:  # a bug in applying must not end the follower: traffic stays
            log.exception("pipeline %s: applying deployment %s failed", name, desired)
        self.heartbeat()  # report a change at once

    def _ask_topic_id(self) -> Future:
        """A future of the control topic's description (answered on the admin client's
        own thread: nothing waits for it)."""
        self._admin.poll(0)  # serves its log lines: nothing else polls it
        topic = self._config.control.topic
        timeout_s = self._config.broker.connect_timeout_s
        return self._admin.describe_topics(TopicCollection([topic]),
                                           request_timeout=timeout_s)[topic]  # fmt: skip

    def _answered_topic_id(self, answer: Future, timeout_s: float = 0) -> str | None:
        """The topic's id, or None: it does not exist, or the broker did not answer."""
        try:
            return str(answer.result(timeout_s).topic_id)
        except Exception as exc:  # any failure: the next check asks again
            log.debug("control topic id not known: %s", exc)
            return None

    def _check_topic(self, answer: Future, consumer: Consumer) -> None:
        """Follow a new incarnation of the control topic when its id changed."""
        topic_id = self._answered_topic_id(answer)
        if topic_id is None or topic_id == self._topic_id:
            return
        if self._topic_id is not None:
            topic = self._config.control.topic
            states, offset = read_latest(self._config, topic, Desired.from_json,
                                         self._config.broker.connect_timeout_s)  # fmt: skip
            log.warning("control topic %r was recreated (id %s, was %s): following it from "
                        "its start", topic, topic_id, self._topic_id)  # fmt: skip
            # Revisions start again: the old topic's no longer hold the new ones back, and
            # a rollback built from them would undo the new topic's changes.
            self._seen.clear()
            self._rollbacks.clear()
            for name, desired in states.items():
                self._follow(name, desired)
            # Where the old topic ended is no place in the new one.
            consumer.assign([TopicPartition(topic, 0, offset)])
        self._topic_id = topic_id

    def _run(self) -> None:
        topic = self._config.control.topic
        consumer = _consumer(self._config, topic, self._offset)
        prefix = f"{self._config.app_id}/"
        interval_s = self._config.control.heartbeat_interval_s
        next_beat = 0.0
        topic_answer: Future | None = None
        try:
            while not self._stopping.is_set():
                if time.monotonic() >= next_beat:
                    self.heartbeat()
                    next_beat = time.monotonic() + interval_s
                    topic_answer = topic_answer or self._ask_topic_id()
                if topic_answer is not None and topic_answer.done():
                    try:
                        self._check_topic(topic_answer, consumer)
                    except ConfigError as exc:  # not read to its end: the next check retries
                        log.warning("%s", exc)
                    topic_answer = None
                self._write_rollbacks()
                message = consumer.poll(min(0.5, interval_s))
                if message is None or message.error():
                    continue
                key = (message.key() or b"").decode()
                if not key.startswith(prefix) or not message.value():
                    continue
                desired = _parse(Desired.from_json, topic, message.offset(), message.value())
                if desired is not None:
                    self._follow(key[len(prefix) :], desired)
        except Exception:
            log.exception("the model control follower stopped; deployments are not followed")
        finally:
            consumer.close()
