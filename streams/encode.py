"""Encode: the answer record of each admitted event, in the pipeline's derived schema
(`schemas/answer.py`), framed with the id it is registered under."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.signature import Signature
from schemas.answer import answer_schema
from schemas.codec import AvroEncoder
from schemas.errors import SchemaFileError
from streams.config import PipelineConfig
from streams.errors import ConfigError
from streams.records import Item, OutRecord


def derived_schema(
    spec: PipelineConfig, input_schema: Mapping[str, Any], task: str
) -> dict[str, Any]:
    """The answer schema of a pipeline; ConfigError names what it cannot carry."""
    try:
        return answer_schema(
            input_schema, spec.included_fields, task, spec.output.record_name,
            spec.output.namespace,
        )  # fmt: skip
    except SchemaFileError as exc:
        raise ConfigError(f"pipeline {spec.name}: {exc}") from exc


class AnswerEncoder:
    def __init__(self, codec: AvroEncoder, output_topic: str, included: list[str]) -> None:
        self._codec = codec
        self._topic = output_topic
        self._included = included

    def encode(
        self,
        item: Item,
        model: Signature,
        answer: Mapping[str, Any],
        missing_views: list[str],
        timings: dict[str, int],
    ) -> OutRecord:
        """`answer` holds the task's fields; the route says how the event was answered."""
        record, event, route = item.record, item.event, item.route
        fields = {name: event[name] for name in self._included}
        fields.update(
            input_topic=record.topic,
            input_partition=record.partition,
            input_offset=record.offset,
            event_timestamp_ms=record.timestamp_ms,
            model_name=model.name,
            model_version=model.version,
        )
        fields.update(answer)
        fields.update(
            status=route.status,
            reason=item.reason,
            degraded_by=route.level,
            missing_features=missing_views,
            timings=timings,
        )
        return OutRecord(self._topic, record.key, self._codec.encode(fields))
