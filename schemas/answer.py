"""The answer record's schema, derived from a pipeline: what consumers of an output
topic read.

An answer carries, in this order: the input fields the pipeline passes through
(`output.include`), where its input came from, which model answered, the model's
answer for its task, and how it was answered (status, reason, degraded_by,
missing_features, timings). For the sample fraud pipeline (include `event_id`, task
`binary`) this is exactly `prediction.avsc`, so its answers keep their schema and id.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import fastavro

from schemas.catalogue import load_schema
from schemas.errors import SchemaFileError

_PREDICTION = {field["name"]: field for field in load_schema("prediction.avsc")["fields"]}


def _shipped(*names: str) -> list[dict[str, Any]]:
    return [copy.deepcopy(_PREDICTION[name]) for name in names]


_SOURCE_FIELDS = (
    "input_topic", "input_partition", "input_offset", "event_timestamp_ms", "model_name",
    "model_version",
)  # fmt: skip
_OUTCOME_FIELDS = ("status", "reason", "degraded_by", "missing_features", "timings")

TASK_FIELDS: dict[str, list[dict[str, Any]]] = {
    "binary": _shipped("score", "label"),
    "multiclass": [
        {"name": "label", "type": ["null", "string"], "default": None,
         "doc": "The most probable class; null when status is SHED."},
        {"name": "score", "type": "float",
         "doc": "Probability of `label`; NaN when status is SHED."},
        {"name": "top_classes", "type": {"type": "array", "items": {
            "type": "record", "name": "ClassProbability", "fields": [
                {"name": "label", "type": "string"},
                {"name": "probability", "type": "float"}]}}, "default": [],
         "doc": "The most probable classes, most probable first (output.top_k of them)."},
    ],
    "regression": [
        {"name": "value", "type": "double",
         "doc": "The model's prediction; NaN when status is SHED."},
    ],
}  # fmt: skip
"""The answer fields of each model task."""

RESERVED = frozenset(_SOURCE_FIELDS + _OUTCOME_FIELDS).union(
    field["name"] for fields in TASK_FIELDS.values() for field in fields
)


def answer_schema(
    input_schema: Mapping[str, Any],
    include: Sequence[str],
    task: str,
    name: str = "Prediction",
    namespace: str = "headrace.predictions",
) -> dict[str, Any]:
    """The answer schema of a pipeline; SchemaFileError names a field it cannot carry."""
    by_name = {field["name"]: field for field in input_schema["fields"]}
    problems = [f"output.include names {f!r}, not a field of {input_schema['name']} "
                f"(fields: {list(by_name)})" for f in include if f not in by_name]  # fmt: skip
    problems += [f"output.include names {f!r}, which every answer carries already"
                 for f in include if f in RESERVED]  # fmt: skip
    if problems:
        raise SchemaFileError("; ".join(problems))
    passed = [_pass_through(by_name[field]) for field in include]
    schema = {
        "type": "record",
        "name": name,
        "namespace": namespace,
        "doc": "One outcome per input event, keyed like the input and written to the "
        "pipeline's output topic.",
        "fields": [
            *passed,
            *_shipped(*_SOURCE_FIELDS),
            *copy.deepcopy(TASK_FIELDS[task]),
            *_shipped(*_OUTCOME_FIELDS),
        ],
    }
    try:
        fastavro.parse_schema(schema)
    except Exception as exc:  # a passed-through type that refers to a named type elsewhere
        raise SchemaFileError(f"the derived answer schema is not valid Avro: {exc}") from exc
    return schema


def _pass_through(field: Mapping[str, Any]) -> dict[str, Any]:
    out = {"name": field["name"], "type": copy.deepcopy(field["type"])}
    if "default" in field:
        out["default"] = field["default"]
    out["doc"] = field.get("doc", "Copied from the input event.")
    return out
