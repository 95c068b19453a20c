"""V2 inference JSON for the MLServer baseline: requests from events, the model matrix
from a (batched) request and its features, and answers read back.

MLServer's Kafka mode reads a V2 inference request as JSON from its input topic, so it
cannot read headrace's Confluent-framed Avro: the benchmark sends it the same events
as V2 JSON, one input per event field (batch dimension first, so MLServer's adaptive
batching can merge requests), with the model named in the `mlserver-model` header.
The answer is a V2 response carrying the score, the label and the input's Kafka
timestamp (see `with_kafka_timestamp`), which the benchmark's latency needs.

Pure functions over JSON and numpy: used by the harness (headrace's environment) and
by the runtime (MLServer's), unit-tested without MLServer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MODEL_NAME = "fraud"
MODEL_HEADER = "mlserver-model"
# Added to each request by the serve shim; the runtime answers it back.
TIMESTAMP_INPUT = "kafka_timestamp_ms"
SCORE_OUTPUT = "score"
LABEL_OUTPUT = "label"
TIMESTAMP_OUTPUT = "event_timestamp_ms"

# A Kafka record as the bench's load generator sends it: key, value, headers.
Record = tuple[bytes, bytes, list[tuple[str, bytes]]]


class V2Error(ValueError):
    """A V2 document that is not what the baseline sends or answers."""


def _datatype(value: Any) -> str:
    # bool before int: a bool is an int in Python.
    if isinstance(value, bool):
        return "BOOL"
    if isinstance(value, int):
        return "INT64"
    if isinstance(value, float):
        return "FP64"
    if isinstance(value, str):
        return "BYTES"
    raise V2Error(f"expected a str, bool, int or float field value, got {type(value).__name__}")


def request(event: Mapping[str, Any]) -> bytes:
    """A V2 inference request for one event: one input of shape [1] per field that has
    a value (a null field is left out, as an absent optional field)."""
    inputs = [
        {"name": name, "datatype": _datatype(value), "shape": [1], "data": [value]}
        for name, value in event.items()
        if value is not None
    ]
    return json.dumps({"inputs": inputs}, separators=(",", ":")).encode()


def record(key: bytes, event: Mapping[str, Any]) -> Record:
    """The Kafka record MLServer's Kafka mode expects: key, V2 JSON, the model header."""
    return key, request(event), [(MODEL_HEADER, MODEL_NAME.encode())]


def with_kafka_timestamp(value: dict, timestamp_ms: int) -> dict:
    """`value` (a parsed V2 request) with the record's Kafka timestamp as one more input."""
    stamp = {"name": TIMESTAMP_INPUT, "datatype": "INT64", "shape": [1], "data": [timestamp_ms]}
    return {**value, "inputs": [*value.get("inputs", []), stamp]}


def entity_rows(
    inputs: Mapping[str, Sequence[Any]], entity_fields: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Feast entity rows of a batch: join key -> the value of the event field carrying it."""
    columns = {key: inputs[field] for key, field in entity_fields.items()}
    rows = len(next(iter(columns.values()))) if columns else 0
    return [{key: values[i] for key, values in columns.items()} for i in range(rows)]


def model_matrix(
    inputs: Mapping[str, Sequence[Any]],
    features: Mapping[str, Sequence[Any]],
    columns: Sequence[tuple[str, float]],
    rows: int,
) -> np.ndarray:
    """The model's float32 (rows, columns) input: each column from an event field or a
    feature (`view__feature`), a missing (None) value replaced by the column's default,
    as headrace does."""
    matrix = np.empty((rows, len(columns)), dtype=np.float32)
    for j, (source, default) in enumerate(columns):
        values = inputs[source] if source in inputs else features.get(source)
        if values is None:
            raise V2Error(f"column {source!r} is neither an input of the request nor a feature")
        if len(values) != rows:
            raise V2Error(f"column {source!r} has {len(values)} values for {rows} rows")
        matrix[:, j] = [default if v is None else v for v in values]
    return matrix


def positive_scores(probabilities: np.ndarray) -> list[float]:
    """The positive class's probability per row (column 1 of two; the only column of one)."""
    matrix = np.asarray(probabilities, dtype=np.float32).reshape(len(probabilities), -1)
    return matrix[:, 0 if matrix.shape[1] == 1 else 1].tolist()


@dataclass(frozen=True)
class Answer:
    timestamp_ms: int
    """The input record's Kafka timestamp."""
    score: float
    label: bool


def read_answer(value: bytes) -> Answer:
    """The answer of one V2 response the runtime made (V2Error if it is not one)."""
    try:
        document = json.loads(value)
        outputs = {o["name"]: o["data"] for o in document["outputs"]}
        names = (TIMESTAMP_OUTPUT, SCORE_OUTPUT, LABEL_OUTPUT)
        stamp, score, label = (outputs[name][0] for name in names)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise V2Error(
            f"expected a V2 response with outputs {TIMESTAMP_OUTPUT}, {SCORE_OUTPUT} and "
            f"{LABEL_OUTPUT}, got {value[:200]!r}"
        ) from exc
    if not math.isfinite(score):
        raise V2Error(f"expected a finite score, got {score!r}")
    return Answer(int(stamp), float(score), bool(label))
