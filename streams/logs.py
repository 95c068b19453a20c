"""Structured logs (`log_format: json`): one JSON object per line, for a log shipper.

Every line has `time` (UTC, ISO 8601), `level`, `logger` and `message`; a line about
records adds what its call site knows of them, passed as `extra` (see `about`):
`pipeline`, `topic`, `partition`, `offset` (one record) or `offsets` (a batch: per
`topic[partition]`, its first and last offset), and `trace_id` with tracing on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

FIELDS = ("pipeline", "topic", "partition", "offset", "offsets", "trace_id")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def use_json_logs() -> None:
    """Format every handler of the root logger as JSON, and Python's warnings with them."""
    for handler in logging.root.handlers:
        handler.setFormatter(JsonFormatter())
    logging.captureWarnings(True)


def faust_json_logging() -> dict[str, Any]:
    """The logging config Faust (mode) is given: it replaces the root's handlers as it
    starts (a new dict each time: mode pops keys from it)."""
    formatter = {"()": "streams.logs.JsonFormatter"}
    return {"merge": True, "formatters": {"default": formatter, "colored": dict(formatter)}}


def about(
    pipeline: str | None = None,
    records: Sequence[Any] = (),
    trace_id: str | None = None,
) -> dict[str, Any]:
    """The `extra` of a log call about `records` (InputRecords) of a pipeline."""
    fields: dict[str, Any] = {"pipeline": pipeline, "trace_id": trace_id}
    if len(records) == 1:
        record = records[0]
        fields.update(topic=record.topic, partition=record.partition, offset=record.offset)
    elif records:
        offsets: dict[str, list[int]] = {}
        for record in records:
            span = offsets.setdefault(f"{record.topic}[{record.partition}]", [record.offset] * 2)
            span[0], span[1] = min(span[0], record.offset), max(span[1], record.offset)
        fields["offsets"] = offsets
    return fields
