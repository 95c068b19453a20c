"""`headrace audit`: check that every consumed input has exactly one outcome.

For each pipeline it reads the input topic up to the consumer group's committed
offsets, and the output and dead-letter topics up to their ends, and matches the
outcomes to the inputs by the (topic, partition, offset) each outcome names. It
reports per input partition the inputs without an outcome, the inputs with more
than one, and the outcomes per status; outcomes of offsets at or past the committed
one (in flight, or written before a crash), and of inputs retention deleted, are
counted apart, they are not errors. A compacted output topic is named where answers
are missing: compaction, not the workers, may have removed them.
The worker's `headrace_outcomes_total` counters reconcile with these totals.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import (
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from infra.kafka_clients import (
    RANGE_READER_SETTINGS,
    client_settings,
    list_topics,
    read_range,
    unavailable,
)
from schemas.codec import AvroDecoder
from schemas.errors import DecodeError
from streams.config import HeadraceConfig, PipelineConfig
from streams.errors import HeadraceError
from streams.publish import topic_settings
from streams.replay import input_named, input_of_dead_letter
from tools.answers import answer_decoder

STATUSES = ("OK", "DEGRADED", "SHED", "DEAD_LETTER")
_SHOWN_OFFSETS = 10


# Per request once the broker answered (a group's first offsets lookup waits for the
# coordinator, seconds on a fresh broker); an unreachable broker is found before that.
_REQUEST_TIMEOUT_S = 30.0


class AuditError(HeadraceError):
    """The topics could not be read completely."""


class AuditTimeout(AuditError):
    """The topics were not read to their ends in time."""

    exit_status = 69


@dataclass
class PartitionAudit:
    partition: int
    committed: int
    """The group's committed offset: inputs below it must have exactly one outcome."""
    inputs: int = 0
    missing: list[int] = field(default_factory=list)
    """Offsets of committed inputs without an outcome."""
    duplicated: list[int] = field(default_factory=list)
    """Offsets of committed inputs with more than one outcome."""
    outcomes: Counter = field(default_factory=Counter)
    """Outcomes of the committed inputs, by status."""
    uncommitted: int = 0
    """Outcomes of offsets at or past the committed one."""
    low: int = 0
    """The partition's first offset still kept (retention deletes from the start)."""
    expired: int = 0
    """Outcomes of inputs below `low`: deleted by retention, so not audited."""
    never_committed: int = 0
    """Inputs on a partition where the group committed nothing: none of them is audited,
    so the partition cannot be called exact (a wrong group, or a worker that never
    committed)."""


@dataclass
class PipelineAudit:
    pipeline: str
    input_topic: str
    partitions: list[PartitionAudit]
    unreadable_outputs: int = 0
    """Records of the output topic that are not readable predictions."""
    compacted_output: bool = False
    """The output topic is compacted: Kafka deletes all but the last answer per key, so
    an input may miss its answer without any loss by the workers."""

    @property
    def missing(self) -> int:
        return sum(len(p.missing) for p in self.partitions)

    @property
    def duplicated(self) -> int:
        return sum(len(p.duplicated) for p in self.partitions)

    @property
    def inputs(self) -> int:
        return sum(p.inputs for p in self.partitions)

    @property
    def outcomes(self) -> Counter:
        return sum((p.outcomes for p in self.partitions), Counter())

    @property
    def exact(self) -> bool:
        unaudited = any(p.never_committed for p in self.partitions)
        # An output it cannot read may be a repeat: exactness is not shown then.
        unread = self.unreadable_outputs > 0
        return self.missing == 0 and self.duplicated == 0 and not unaudited and not unread

    def as_dict(self) -> dict:
        return {
            "pipeline": self.pipeline,
            "input_topic": self.input_topic,
            "inputs": self.inputs,
            "missing": self.missing,
            "duplicated": self.duplicated,
            "outcomes": {status: self.outcomes[status] for status in STATUSES},
            "unreadable_outputs": self.unreadable_outputs,
            "compacted_output": self.compacted_output,
            "partitions": [
                {
                    "partition": p.partition,
                    "committed": p.committed,
                    "inputs": p.inputs,
                    "missing": len(p.missing),
                    "duplicated": len(p.duplicated),
                    "first_missing": p.missing[:_SHOWN_OFFSETS],
                    "first_duplicated": p.duplicated[:_SHOWN_OFFSETS],
                    "outcomes": {status: p.outcomes[status] for status in STATUSES},
                    "uncommitted": p.uncommitted,
                    "expired": p.expired,
                    "never_committed": p.never_committed,
                }
                for p in self.partitions
            ],
        }


# Errors of a partition whose leader is moving (or was just created): the audit reads
# everything again, up to `_ATTEMPTS` times, before it calls Kafka unavailable.
_LEADER_MOVING = frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE})
_ATTEMPTS = 3


def audit(config: HeadraceConfig, timeout_s: float = 120.0) -> list[PipelineAudit]:
    """Audit every pipeline of `config`; blocks while it reads the topics (up to
    `timeout_s`). BrokerUnavailable when Kafka does not answer within the broker's
    `connect_timeout_ms` or fails half way; AuditError when a topic does not exist."""
    broker = config.broker
    existing = list_topics(broker.bootstrap_servers, broker.connect_timeout_s)
    for spec in config.pipelines:
        for topic in (spec.input_topic, spec.output_topic, spec.dead_letter_topic):
            if topic not in existing:
                raise AuditError(
                    f"pipeline {spec.name}: topic {topic!r} does not exist; hint: check the "
                    "config's topic names (`headrace topics create` makes them)"
                )
    decoder = answer_decoder(config)
    clients = _Clients(broker.bootstrap_servers, broker.connect_timeout_s)
    attempt = 1
    while True:
        try:
            return [
                _audit_pipeline(clients, config.app_id, spec, decoder, timeout_s)
                for spec in config.pipelines
            ]
        except KafkaException as exc:
            if exc.args[0].code() not in _LEADER_MOVING or attempt == _ATTEMPTS:
                raise unavailable(
                    broker.bootstrap_servers, f"failed during the audit ({exc.args[0].str()})"
                ) from exc
            attempt += 1
            time.sleep(0.5)


@dataclass(frozen=True)
class _Clients:
    bootstrap: str
    connect_timeout_s: float

    def consumer(self, group: str, **settings) -> Consumer:
        base = client_settings(self.bootstrap, "audit", self.connect_timeout_s)
        return Consumer({**base, "group.id": group, **settings})


def _audit_pipeline(
    clients: _Clients, group: str, spec: PipelineConfig, decoder: AvroDecoder, timeout_s: float
) -> PipelineAudit:
    committed, never_committed, lows = _committed(clients, group, spec.input_topic)
    # (partition, offset) -> statuses of the outcomes naming it.
    answers: dict[tuple[int, int], list[str]] = {}
    unreadable = 0

    def on_output(message: Message) -> None:
        nonlocal unreadable
        try:
            answer = decoder.decode(message.value())
        except DecodeError:
            unreadable += 1
            return
        named = input_named(answer)
        if named is None:
            unreadable += 1
        elif named[0] == spec.input_topic:
            answers.setdefault(named[1:], []).append(str(answer.get("status")))

    def on_dead_letter(message: Message) -> None:
        named = input_of_dead_letter(message)
        if named is not None and named[0] == spec.input_topic:
            answers.setdefault(named[1:], []).append("DEAD_LETTER")

    deadline = time.monotonic() + timeout_s
    _read(clients, spec.output_topic, None, on_output, deadline)
    _read(clients, spec.dead_letter_topic, None, on_dead_letter, deadline)

    partitions = {
        p: PartitionAudit(p, offset, never_committed=never_committed.get(p, 0), low=lows[p])
        for p, offset in committed.items()
    }

    def on_input(message: Message) -> None:
        found = partitions[message.partition()]
        found.inputs += 1
        statuses = answers.pop((message.partition(), message.offset()), [])
        if not statuses:
            found.missing.append(message.offset())
        elif len(statuses) > 1:
            found.duplicated.append(message.offset())
        found.outcomes.update(statuses)

    _read(clients, spec.input_topic, committed, on_input, deadline)
    # What is left answers inputs not read above: past the committed offsets, or gone.
    for (partition, offset), statuses in answers.items():
        found = partitions.get(partition)
        if found is None:
            continue
        if offset < found.low:
            found.expired += len(statuses)
        else:
            found.uncommitted += len(statuses)
    policy = topic_settings(
        clients.bootstrap, [spec.output_topic], "cleanup.policy", clients.connect_timeout_s
    )[spec.output_topic]
    return PipelineAudit(
        spec.name, spec.input_topic, list(partitions.values()), unreadable,
        compacted_output="compact" in policy.split(","),
    )  # fmt: skip


def _committed(
    clients: _Clients, group: str, topic: str
) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """The group's committed offset per partition of `topic` (the low watermark if none);
    per partition where it committed nothing, how many inputs it holds; and each
    partition's low watermark."""
    consumer = clients.consumer(group)
    try:
        partitions = _partitions(consumer, topic)
        offsets, never, lows = {}, {}, {}
        wanted = [TopicPartition(topic, p) for p in partitions]
        for tp in consumer.committed(wanted, timeout=_REQUEST_TIMEOUT_S):
            low, high = consumer.get_watermark_offsets(tp, timeout=_REQUEST_TIMEOUT_S)
            lows[tp.partition] = low
            if tp.offset == OFFSET_INVALID:
                offsets[tp.partition] = low
                if high > low:
                    never[tp.partition] = high - low
            else:
                offsets[tp.partition] = max(tp.offset, low)
        return offsets, never, lows
    finally:
        consumer.close()


def _partitions(consumer: Consumer, topic: str) -> list[int]:
    metadata = consumer.list_topics(topic, timeout=_REQUEST_TIMEOUT_S).topics.get(topic)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        raise AuditError(f"topic {topic!r} does not exist; hint: check the config's topic names")
    return sorted(metadata.partitions)


def _read(
    clients: _Clients,
    topic: str,
    ends: dict[int, int] | None,
    handle: Callable[[Message], None],
    deadline: float,
) -> None:
    """Hand every record of `topic` below `ends` (default: the current end) to `handle`.
    Reads committed records only (isolation.level=read_committed): a topic written in
    transactions ends with a marker, and aborted records are never read, so the end of
    a partition is where Kafka says it is (an end-of-partition event), not its last
    record read."""
    consumer = clients.consumer(f"headrace-audit-{uuid.uuid4().hex[:8]}", **{
        **RANGE_READER_SETTINGS, "isolation.level": "read_committed"})  # fmt: skip
    try:
        starts, stops = {}, {}
        for partition in _partitions(consumer, topic):
            where = TopicPartition(topic, partition)
            low, high = consumer.get_watermark_offsets(where, _REQUEST_TIMEOUT_S)
            starts[partition] = low
            stops[partition] = high if ends is None else min(ends.get(partition, low), high)
        try:
            read_range(consumer, topic, starts, stops, handle, deadline)
        except TimeoutError as exc:
            raise AuditTimeout(
                f"timed out reading {exc}; hint: a large topic needs a longer --timeout"
            ) from exc
    finally:
        consumer.close()


def format_report(audits: list[PipelineAudit]) -> str:
    """A plain-text table per pipeline, then a verdict line."""
    lines = []
    header = ("partition", "committed", "inputs", "missing", "duplicated", *STATUSES,
              "uncommitted", "expired")  # fmt: skip
    for found in audits:
        lines.append(f"pipeline {found.pipeline} (input {found.input_topic})")
        rows = [header]
        for p in found.partitions:
            rows.append(
                (p.partition, p.committed, p.inputs, len(p.missing), len(p.duplicated),
                 *(p.outcomes[s] for s in STATUSES), p.uncommitted, p.expired)
            )  # fmt: skip
        totals = found.outcomes
        rows.append(
            ("total", "", found.inputs, found.missing, found.duplicated,
             *(totals[s] for s in STATUSES), sum(p.uncommitted for p in found.partitions),
             sum(p.expired for p in found.partitions))
        )  # fmt: skip
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        lines += ["  " + "  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True))
                  for row in rows]  # fmt: skip
        for p in found.partitions:
            if p.missing:
                lines.append(f"  partition {p.partition}: no outcome for offsets {p.missing[:10]}")
            if p.duplicated:
                lines.append(f"  partition {p.partition}: several for offsets {p.duplicated[:10]}")
            if p.never_committed:
                lines.append(
                    f"  partition {p.partition}: the group committed nothing of its "
                    f"{p.never_committed} inputs, so none was audited (hint: is the config's "
                    "app_id the workers' group?)"
                )
        if found.compacted_output and found.missing:
            lines.append(
                "  the output topic is compacted (cleanup.policy): Kafka keeps only the last "
                "answer per key, so answers missing here may have been compacted away, not "
                "lost (hint: audit an output topic with cleanup.policy=delete)"
            )
        if any(p.expired for p in found.partitions):
            lines.append(
                "  expired: outcomes of inputs that retention deleted from the input topic "
                "(not audited)"
            )
        if found.unreadable_outputs:
            lines.append(
                f"  {found.unreadable_outputs} unreadable records in the output topic: not "
                "answers this registry can decode, so they may hide repeats (hint: does "
                "another producer write there, or was the registry reset?)"
            )
    exact = all(found.exact for found in audits)
    lines.append(
        "every committed input has exactly one outcome"
        if exact
        else "NOT EXACT: inputs without an outcome, with more than one, or not audited, or "
        "outputs it cannot read (see above)"
    )
    return "\n".join(lines)
