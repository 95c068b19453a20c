"""The stages of one micro-batch: prepare (decode, validate, features), infer, publish.

The stages are independent of Faust so that the runner can overlap them across
batches and the benchmarks can drive them without a consumer. `publish` returns
once every input of the batch has exactly one outcome durably written to Kafka (a
prediction or a dead-letter record), and raises if it could not write them all:
the caller must not acknowledge the batch then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from features.lookup import FeatureLookup, FeatureRows
from models.errors import ModelError
from models.pool import SessionPool
from models.session import ModelMetadata
from schemas.codec import AvroDecoder, AvroEncoder
from schemas.errors import DecodeError
from schemas.validation import validate_transaction
from streams import metrics
from streams.config import PipelineConfig
from streams.publisher import OutRecord, Publisher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputRecord:
    """A consumed Kafka record, as the pipeline needs it."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None


@dataclass
class Prepared:
    """A batch after decoding and the feature read, ready for the model."""

    records: Sequence[InputRecord]
    outcomes: list[OutRecord | None]
    """Dead letters in place; None where a prediction will go."""
    events: list[dict[str, Any]] = field(default_factory=list)
    scored: list[InputRecord] = field(default_factory=list)
    rows: FeatureRows | None = None
    timings: dict[str, int] = field(default_factory=dict)


class Pipeline:
    def __init__(
        self,
        config: PipelineConfig,
        decoder: AvroDecoder,
        encoder: AvroEncoder,
        lookup: FeatureLookup,
        model: SessionPool,
        publisher: Publisher,
        event_fields: Sequence[str],
    ) -> None:
        self.config = config
        self.model = model
        self._decoder = decoder
        self._encoder = encoder
        self._lookup = lookup
        self._publisher = publisher
        self._metrics = metrics.PipelineMetrics(config.name)
        self._columns = _column_sources(model.metadata, lookup.feature_refs, event_fields)
        self._defaults = np.asarray(model.metadata.feature_defaults, dtype=np.float32)

    async def prepare(self, records: Sequence[InputRecord]) -> Prepared:
        """Decode and validate (bad inputs become dead letters), then read features."""
        measure = self._metrics
        started = time.perf_counter()
        admitted_ms = time.time() * 1000
        prepared = Prepared(records, [None] * len(records))
        for index, record in enumerate(records):
            measure.admission_lag.observe(max(0.0, admitted_ms - record.timestamp_ms) / 1000)
            try:
                event = self._decoder.decode(record.value)
                validate_transaction(event)
            except DecodeError as exc:
                prepared.outcomes[index] = self._dead_letter(record, exc)
                continue
            prepared.events.append(event)
            prepared.scored.append(record)
        decoded = time.perf_counter()
        measure.stage["decode"].observe(decoded - started)
        if prepared.events:
            prepared.rows = await self._lookup.fetch(prepared.events)
        fetched = time.perf_counter()
        measure.stage["features"].observe(fetched - decoded)
        prepared.timings = {
            "batch_size": len(records),
            "decode_us": _us(started, decoded),
            "features_us": _us(decoded, fetched),
        }
        return prepared

    async def infer(self, prepared: Prepared) -> np.ndarray:
        """Scores of the prepared events (one model run for the whole batch)."""
        if not prepared.events:
            return np.empty(0, dtype=np.float32)
        started = time.perf_counter()
        scores = await self.model.predict(self._assemble(prepared.events, prepared.rows))
        seconds = time.perf_counter() - started
        self._metrics.stage["inference"].observe(seconds)
        prepared.timings["inference_us"] = int(seconds * 1_000_000)
        return scores

    async def publish(self, prepared: Prepared, scores: np.ndarray) -> None:
        """Encode the predictions and write every outcome; returns once Kafka has them all."""
        measure = self._metrics
        started = time.perf_counter()
        outcomes = prepared.outcomes
        if prepared.events:
            prepared.timings.setdefault("inference_us", 0)
            predictions = iter(self._encode(prepared, scores))
            outcomes = [o if o is not None else next(predictions) for o in outcomes]
        encoded = time.perf_counter()
        await self._publisher.publish(outcomes)
        published = time.perf_counter()

        measure.stage["encode"].observe(encoded - started)
        measure.stage["publish"].observe(published - encoded)
        measure.batch_size.observe(len(prepared.records))
        now_ms = time.time() * 1000
        for record in prepared.records:
            measure.end_to_end.observe(max(0.0, now_ms - record.timestamp_ms) / 1000)
        dead = len(prepared.records) - len(prepared.events)
        measure.predictions.inc(len(prepared.events))
        measure.dead_letters.inc(dead)

    def _assemble(self, events: list[dict[str, Any]], rows: FeatureRows) -> np.ndarray:
        """The float32 model input; NaN (missing store values) becomes the model's default."""
        matrix = np.empty((len(events), len(self._columns)), dtype=np.float32)
        for column, (source, name) in enumerate(self._columns):
            if source == "store":
                matrix[:, column] = rows.columns[name]
            else:
                matrix[:, column] = [event[name] for event in events]
        missing = np.isnan(matrix)
        if missing.any():
            matrix[missing] = np.broadcast_to(self._defaults, matrix.shape)[missing]
        return matrix

    def _encode(self, prepared: Prepared, scores: np.ndarray) -> list[OutRecord]:
        meta = self.model.metadata
        timings = prepared.timings
        out = []
        for record, event, missing, score in zip(
            prepared.scored, prepared.events, prepared.rows.missing_views, scores.tolist(),
            strict=True,
        ):  # fmt: skip
            for view in missing:
                self._metrics.missing_features(view).inc()
            value = self._encoder.encode(
                prediction(event, record, meta, score, list(missing), timings)
            )
            out.append(OutRecord(self.config.output_topic, record.key, value))
        return out

    def _dead_letter(self, record: InputRecord, error: DecodeError) -> OutRecord:
        log.warning(
            "dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, error
        )
        self._metrics.dead_letter_reason(error.reason).inc()
        headers = [
            ("headrace.error.reason", error.reason.encode()),
            ("headrace.error.message", str(error).encode()),
            ("headrace.pipeline", self.config.name.encode()),
            ("headrace.input.topic", record.topic.encode()),
            ("headrace.input.partition", str(record.partition).encode()),
            ("headrace.input.offset", str(record.offset).encode()),
        ]
        return OutRecord(self.config.dead_letter_topic, record.key, record.value, headers)


def prediction(
    event: dict[str, Any],
    record: InputRecord,
    meta: ModelMetadata,
    score: float,
    missing_views: list[str],
    timings: dict[str, int],
) -> dict[str, Any]:
    """The Prediction record (`schemas/prediction.avsc`) answering `record` with status OK."""
    return {
        "event_id": event["event_id"],
        "input_topic": record.topic,
        "input_partition": record.partition,
        "input_offset": record.offset,
        "event_timestamp_ms": record.timestamp_ms,
        "model_name": meta.name,
        "model_version": meta.version,
        "score": score,
        "label": score >= meta.threshold,
        "status": "OK",
        "reason": None,
        "missing_features": missing_views,
        "timings": timings,
    }


def _column_sources(
    meta: ModelMetadata, feature_refs: Sequence[str], event_fields: Sequence[str]
) -> list[tuple[str, str]]:
    """Where each model input comes from: the feature store or the event itself."""
    sources = []
    for name in meta.feature_names:
        if name in feature_refs:
            sources.append(("store", name))
        elif name in event_fields:
            sources.append(("event", name))
        else:
            raise ModelError(
                f"model {meta.name} needs input {name!r}, which is neither a field of the "
                f"event nor a feature of the pipeline's feature service ({list(feature_refs)})"
            )
    return sources


def _us(start: float, end: float) -> int:
    return int((end - start) * 1_000_000)
