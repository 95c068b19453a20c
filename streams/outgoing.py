"""The records one batch writes: its outcomes (answers, and dead letters of the inputs
that cannot be answered), what Kafka acknowledged of them, and the smaller forms a
record takes when it cannot be written as it is.

A dead letter carries its input's own key and bytes, with why and where it came from
in headers. A record that does not fit where it goes (`Outgoing.reduce`) becomes, step
by step: for an answer, the dead letter of its input (reason `too_large`, or
`unpublishable` for a record Kafka finds invalid); then a dead letter whose value is
cut to its first `KEPT_BYTES`, with the whole value's size and sha256 in headers
(`headrace.value.size`, `headrace.value.sha256`) and the reason it was first
dead-lettered for in `headrace.error.cause`; then one without key or value. Every form
keeps the trace headers and the `headrace.redelivered` marker of the first.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence

from schemas.errors import DecodeError
from schemas.validation import InvalidEventError
from streams.errors import PublishError
from streams.logs import about
from streams.records import InputRecord, Item, OutRecord
from streams.tracing import TRACEPARENT, TRACESTATE

log = logging.getLogger(__name__)

TOO_LARGE = "too_large"
UNPUBLISHABLE = "unpublishable"
# On the outcome of an input read again after a handover whose check could not see an
# earlier answer (`streams/replay.py`): a consumer keeps the first answer of these.
REDELIVERED = "headrace.redelivered"
# Headers every smaller form of a record keeps.
_KEPT = (TRACEPARENT, TRACESTATE, REDELIVERED)
# What a cut dead letter keeps of its value: enough to see its framing and schema id.
KEPT_BYTES = 1_024
# A cut dead letter's header values are cut to this too (a message may quote a field).
MAX_HEADER_BYTES = 1_024
# A record batch of one record, beyond its key, value and headers: the batch header
# (61 bytes) and the record's varints (at most 41), and two varints per header (10).
_BATCH_OVERHEAD_BYTES = 61 + 41
_HEADER_OVERHEAD_BYTES = 10


def dead_letter(
    record: InputRecord, error: DecodeError, pipeline: str, topic: str, trace_id: str | None = None
) -> OutRecord:
    """The input's own key and bytes, with why and where it came from in headers."""
    log.warning(
        "dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, error,
        extra=about(pipeline, [record], trace_id),
    )  # fmt: skip
    headers = [
        ("headrace.error.reason", error.reason.encode()),
        ("headrace.error.message", str(error).encode()),
        *_origin(record, pipeline),
    ]
    if isinstance(error, InvalidEventError):
        headers.append(("headrace.error.rule", f"{error.field}.{error.rule}".encode()))
    return OutRecord(topic, record.key, record.value, headers)


def mark_redelivered(items: Sequence[Item], records: Sequence[OutRecord]) -> None:
    """Add the `headrace.redelivered` header to the outcomes of inputs read again (once:
    a retry marks again what was marked since the last attempt)."""
    for item, record in zip(items, records, strict=True):
        if item.redelivered and all(name != REDELIVERED for name, _ in record.headers):
            record.headers.append((REDELIVERED, b"1"))


def _origin(record: InputRecord, pipeline: str) -> list[tuple[str, bytes]]:
    return [
        ("headrace.pipeline", pipeline.encode()),
        ("headrace.input.topic", record.topic.encode()),
        ("headrace.input.partition", str(record.partition).encode()),
        ("headrace.input.offset", str(record.offset).encode()),
    ]


def wire_bytes(record: OutRecord) -> int:
    """The size of a record batch holding only `record`, at most (no compression)."""
    size = _BATCH_OVERHEAD_BYTES + len(record.value or b"") + len(record.key or b"")
    for name, value in record.headers:
        size += _HEADER_OVERHEAD_BYTES + len(name) + len(value or b"")
    return size


class Outgoing:
    """One batch's outcome records on their way to Kafka, and what Kafka acknowledged
    of them. Kept across publish retries, so that a retry sends only the rest.
    `inputs[i]` is the input `records[i]` answers or dead-letters."""

    def __init__(
        self,
        records: list[OutRecord],
        inputs: Sequence[InputRecord],
        pipeline: str,
        dead_letter_topic: str,
    ) -> None:
        if len(records) != len(inputs):
            raise ValueError(f"{len(records)} records for {len(inputs)} inputs")
        self.records = records
        self.inputs = inputs
        self.pipeline = pipeline
        self.dead_letter_topic = dead_letter_topic
        self.delivered = [False] * len(records)
        """Set by the delivery reports (in the poll thread)."""
        self.rewritten: dict[int, str] = {}
        """Index -> reason of the dead letter written in place of the record first made."""
        self._forms: dict[int, int] = {}
        self._first: dict[int, OutRecord] = {}
        self._first_why: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[OutRecord]:
        return iter(self.records)

    def undelivered(self) -> list[int]:
        return [index for index, done in enumerate(self.delivered) if not done]

    def reduce(self, index: int, reason: str, why: str) -> OutRecord:
        """Replace record `index` by its next smaller form and return it: an answer by
        its input's dead letter, then a dead letter with its value cut to `KEPT_BYTES`
        (and header values cut), then one without key or value. PublishError when even
        that was refused."""
        record, source = self.records[index], self.inputs[index]
        first = self._first.setdefault(index, record)
        first_why = self._first_why.setdefault(index, why)
        form = self._forms.get(index, 0) + 1
        if form == 1 and _reason_of(first) is not None:
            form = 2  # a dead letter already
        where = f"{source.topic}[{source.partition}]@{source.offset}"
        if form > 3:
            raise PublishError(
                f"{where}: even its dead letter without key or value cannot be written to "
                f"{record.topic!r} ({why}); hint: check that topic's config "
                "(max.message.bytes, cleanup.policy)"
            )
        if form == 1:
            message = f"its answer cannot be written: {why}"
            headers = [("headrace.error.reason", reason.encode()),
                       ("headrace.error.message", message.encode()),
                       *_origin(source, self.pipeline), *_kept_headers(first)]  # fmt: skip
            replaced = OutRecord(self.dead_letter_topic, source.key, source.value, headers)
            log.warning("%s: %s; dead-lettering its input (%s)", where, message, reason,
                        extra=about(self.pipeline, [source]))  # fmt: skip
        else:
            replaced = self._cut(record, first, first_why, source, reason, why, keep_key=form == 2)
            log.warning("%s: %s; writing its dead letter %s (%s)", where, why,
                        "cut" if form == 2 else "without key or value", reason,
                        extra=about(self.pipeline, [source]))  # fmt: skip
        self._forms[index] = form
        self.records[index] = replaced
        self.rewritten[index] = reason
        return replaced

    def _cut(
        self,
        current: OutRecord,
        first: OutRecord,
        first_why: str,
        source: InputRecord,
        reason: str,
        why: str,
        keep_key: bool,
    ) -> OutRecord:
        value = source.value or b""
        kept = value[:KEPT_BYTES] if keep_key else b""
        cause = _reason_of(first)
        message = f"its dead letter cannot be written whole: {why}; written with " + (
            f"the first {len(kept)} of its {len(value)} bytes" if keep_key else "no key or value"
        )
        if cause is not None:
            message += f"; dead-lettered for: {_header(first, 'headrace.error.message')}"
        else:
            message += f"; its answer cannot be written: {first_why}"
        headers = [("headrace.error.reason", reason.encode()),
                   ("headrace.error.message", message.encode()[:MAX_HEADER_BYTES])]  # fmt: skip
        if cause is not None:
            headers.append(("headrace.error.cause", cause.encode()))
        rule = _header(first, "headrace.error.rule")
        if rule is not None:
            headers.append(("headrace.error.rule", rule.encode()[:MAX_HEADER_BYTES]))
        headers += _origin(source, self.pipeline)
        # The current form's: a retry may have marked it redelivered since the first.
        headers += _kept_headers(current)
        headers += [
            ("headrace.value.size", str(len(value)).encode()),
            ("headrace.value.sha256", hashlib.sha256(value).hexdigest().encode()),
        ]
        key = source.key
        if not keep_key and key is not None:
            headers += [
                ("headrace.key.size", str(len(key)).encode()),
                ("headrace.key.sha256", hashlib.sha256(key).hexdigest().encode()),
            ]
            key = None
        return OutRecord(self.dead_letter_topic, key, kept if keep_key else None, headers)


def _kept_headers(record: OutRecord) -> list[tuple[str, bytes]]:
    return [(name, value) for name, value in record.headers if name in _KEPT]


def _header(record: OutRecord, name: str) -> str | None:
    for key, value in record.headers:
        if key == name:
            return value.decode(errors="replace")
    return None


def _reason_of(record: OutRecord) -> str | None:
    """A dead letter's reason; None for an answer (answers carry no headers)."""
    return _header(record, "headrace.error.reason") if record.headers else None
