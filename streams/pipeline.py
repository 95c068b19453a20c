"""The stages of one micro-batch: decode (and validate), route, read features, infer,
publish.

Between `decode` and `read_features` the runner has `route` decide each event's path
(`streams/admission.py`), so no feature or model work is spent on an event that
cannot use it; it may revise the full-path events again before `infer`, which runs the
full and the fallback model once each. The stages are independent of Faust so that
the runner can overlap them across batches and the benchmarks can drive them
without a consumer. `publish` returns once every input of the batch has exactly one
outcome durably written to Kafka (an OK, DEGRADED or SHED answer, or a dead-letter
record), and raises if it could not write them all: the caller must not acknowledge
the batch then. Outcome counters move only after that.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from features.cache import FeatureCache
from features.lookup import FeatureLookup, FeatureRows
from models.errors import ModelError
from models.pool import SessionPool
from models.session import ModelMetadata
from schemas.codec import AvroDecoder, AvroEncoder
from schemas.errors import DecodeError
from schemas.validation import validate_transaction
from streams import metrics
from streams.admission import Admission, Candidate, Estimates, Ladder, Route
from streams.config import PipelineConfig
from streams.errors import ConfigError
from streams.publisher import OutRecord, Publisher

log = logging.getLogger(__name__)


class InputRecord(NamedTuple):
    """A consumed Kafka record, as the pipeline needs it. A tuple: one is built per
    consumed record, and a frozen dataclass costs several times as much to build."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()


@dataclass
class Admitted:
    """A decoded input of a batch and how it will be answered."""

    record: InputRecord
    event: dict[str, Any]
    deadline_s: float
    priority: int
    route: Route
    reason: str | None
    cache_key: tuple
    cached_score: float | None
    row: int | None = None
    """Its row in the batch's feature rows, where it needed store features."""
    score: float = math.nan


@dataclass
class Prepared:
    """A batch after decoding, admission and the feature read, ready for the models."""

    records: Sequence[InputRecord]
    outcomes: list[OutRecord | None]
    """Dead letters in place; None where an answer will go."""
    dead: list[tuple[InputRecord, str]] = field(default_factory=list)
    """The dead-lettered inputs with their reason codes."""
    admitted: list[Admitted] = field(default_factory=list)
    rows: FeatureRows | None = None
    timings: dict[str, int] = field(default_factory=dict)
    run_seconds: dict[Route, float] = field(default_factory=dict)
    """Seconds of each model run (full, fallback) of the batch."""

    def count(self, route: Route) -> int:
        return sum(1 for item in self.admitted if item.route is route)


class _Model:
    """A session pool and where each of its inputs comes from."""

    def __init__(
        self, pool: SessionPool, feature_refs: Sequence[str], event_fields: Sequence[str]
    ) -> None:
        self.pool = pool
        self.metadata = pool.metadata
        self.columns = _column_sources(pool.metadata, feature_refs, event_fields)
        self.needs_store = any(source == "store" for source, _ in self.columns)
        self.defaults = np.asarray(pool.metadata.feature_defaults, dtype=np.float32)

    def assemble(self, items: Sequence[Admitted], rows: FeatureRows | None) -> np.ndarray:
        """The float32 model input; NaN (missing store values) becomes the model's default."""
        matrix = np.empty((len(items), len(self.columns)), dtype=np.float32)
        if self.needs_store:
            picked = np.fromiter((item.row for item in items), dtype=np.intp, count=len(items))
        for column, (source, name) in enumerate(self.columns):
            if source == "store":
                matrix[:, column] = rows.columns[name][picked]
            else:
                matrix[:, column] = [item.event[name] for item in items]
        missing = np.isnan(matrix)
        if missing.any():
            matrix[missing] = np.broadcast_to(self.defaults, matrix.shape)[missing]
        return matrix


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
        fallback: SessionPool | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.model = model
        self.fallback_model = fallback
        self._decoder = decoder
        self._encoder = encoder
        self._lookup = lookup
        self._publisher = publisher
        self._clock = clock
        self.metrics = metrics.PipelineMetrics(config.name)
        self._full = _Model(model, lookup.feature_refs, event_fields)
        self._fallback = _Model(fallback, lookup.feature_refs, event_fields) if fallback else None
        for role, name in (
            ("event_time_field", config.event_time_field),
            ("priority.field", config.priority.field),
        ):
            if name is not None and name not in event_fields:
                raise ConfigError(
                    f"pipeline {config.name}: {role} {name!r} is not a field of the input "
                    f"schema (fields: {list(event_fields)})"
                )
        degradation = config.degradation
        self._budget_s = config.latency_budget_ms / 1000
        self.admission = Admission(
            self._budget_s,
            config.priority.budget_shares,
            Ladder(
                fallback_model=fallback is not None,
                answer_cache=degradation.answer_cache.max_entries > 0,
                default_answer=degradation.default_score is not None,
            ),
        )
        # An identical input: the same entity keys and the same event inputs of the model.
        event_inputs = [name for source, name in self._full.columns if source == "event"]
        self._answer_fields = tuple(dict.fromkeys([*config.entity_fields.values(), *event_inputs]))
        # The feature cache's LRU and age bound serve answers too (value: the score).
        self._answers = FeatureCache(
            degradation.answer_cache.max_entries, degradation.answer_cache.max_age_s, clock
        )

    def decode(self, records: Sequence[InputRecord]) -> Prepared:
        """Decode and validate (bad inputs become dead letters); every decoded event starts
        on the full path, for the runner's admission (`route`) to decide."""
        measure = self.metrics
        started = time.perf_counter()
        now_s = self._clock()
        metrics.observe_many(
            measure.admission_lag, [max(0.0, now_s - r.timestamp_ms / 1000) for r in records]
        )
        prepared = Prepared(records, [None] * len(records))
        for index, record in enumerate(records):
            try:
                event = self._decoder.decode(record.value)
                validate_transaction(event)
            except DecodeError as exc:
                prepared.outcomes[index] = self._dead_letter(record, exc)
                prepared.dead.append((record, exc.reason))
                continue
            prepared.admitted.append(self._candidate(record, event))
        seconds = time.perf_counter() - started
        measure.stage["decode"].observe(seconds)
        prepared.timings = {"batch_size": len(records), "decode_us": int(seconds * 1e6)}
        return prepared

    def route(self, items: Sequence[Admitted], estimates: Estimates) -> None:
        """Decide, or revise, the route of each item (in batch order) by its deadline."""
        candidates = [
            Candidate(item.deadline_s, item.priority, item.cached_score is not None)
            for item in items
        ]
        decisions = self.admission.decide(candidates, self._clock(), estimates)
        for item, decision in zip(items, decisions, strict=True):
            item.route, item.reason = decision.route, decision.reason

    async def read_features(self, prepared: Prepared) -> None:
        """One store read (through the cache) for the events whose model needs it."""
        needing = [item for item in prepared.admitted if self._needs_store(item.route)]
        prepared.timings["features_us"] = 0
        if not needing:
            return
        started = time.perf_counter()
        for row, item in enumerate(needing):
            item.row = row
        prepared.rows = await self._lookup.fetch([item.event for item in needing])
        seconds = time.perf_counter() - started
        self.metrics.stage["features"].observe(seconds)
        prepared.timings["features_us"] = int(seconds * 1e6)

    def _candidate(self, record: InputRecord, event: dict[str, Any]) -> Admitted:
        time_field = self.config.event_time_field
        event_time_ms = event[time_field] if time_field else record.timestamp_ms
        key = tuple(event[name] for name in self._answer_fields)
        cached = self._answers.get(key) if self.admission.ladder.answer_cache else None
        return Admitted(
            record,
            event,
            deadline_s=event_time_ms / 1000 + self._budget_s,
            priority=self._priority(record, event),
            route=Route.FULL,
            reason=None,
            cache_key=key,
            cached_score=None if cached is None else cached[0],
        )

    def _priority(self, record: InputRecord, event: dict[str, Any]) -> int:
        spec = self.config.priority
        value: Any = None
        if spec.header is not None:
            for name, raw in record.headers:
                if name == spec.header:
                    value = raw
        if value is None and spec.field is not None:
            value = event.get(spec.field)
        try:
            return self.admission.clamp(int(value))
        except (TypeError, ValueError):  # absent or not a number
            return spec.default

    def _needs_store(self, route: Route) -> bool:
        if route is Route.FULL:
            return True
        return route is Route.FALLBACK and self._fallback.needs_store

    async def infer(self, prepared: Prepared) -> None:
        """Run the full and the fallback model on their events, one run each, at once.
        An event moved off the full path after its features were read can still take
        the fallback model: it has every input."""
        runs = [(Route.FULL, self._full), (Route.FALLBACK, self._fallback)]
        await asyncio.gather(*(self._run(prepared, route, model) for route, model in runs))

    async def _run(self, prepared: Prepared, route: Route, model: _Model | None) -> None:
        items = [item for item in prepared.admitted if item.route is route]
        if not items:
            return
        scores, seconds = await model.pool.predict_timed(model.assemble(items, prepared.rows))
        if route is Route.FULL:
            self.metrics.stage["inference"].observe(seconds)
        prepared.run_seconds[route] = seconds
        for item, score in zip(items, scores.tolist(), strict=True):
            item.score = score

    async def publish(self, prepared: Prepared) -> None:
        """Encode an answer for every admitted event and write every outcome; returns
        once Kafka has them all."""
        measure = self.metrics
        started = time.perf_counter()
        answers = iter(self._encode(prepared))
        outcomes = [o if o is not None else next(answers) for o in prepared.outcomes]
        encoded = time.perf_counter()
        await self._publisher.publish(outcomes)
        published = time.perf_counter()

        measure.stage["encode"].observe(encoded - started)
        measure.stage["publish"].observe(published - encoded)
        measure.batch_size.observe(len(prepared.records))
        self._count(prepared)

    def _encode(self, prepared: Prepared) -> list[OutRecord]:
        timings = {
            route: {**prepared.timings, "inference_us": int(seconds * 1e6)}
            for route, seconds in prepared.run_seconds.items()
        }
        no_run = {**prepared.timings, "inference_us": 0}
        missing_of = prepared.rows.missing_views if prepared.rows is not None else []
        out = []
        for item in prepared.admitted:
            route = item.route
            meta = self._fallback.metadata if route is Route.FALLBACK else self.model.metadata
            score = {
                Route.CACHED: item.cached_score,
                Route.DEFAULT: self.config.degradation.default_score,
            }.get(route, item.score)
            read_store = item.row is not None and self._needs_store(route)
            missing = list(missing_of[item.row]) if read_store else []
            if route is Route.FULL:
                for view in missing:
                    self.metrics.missing_features(view).inc()
            timing = timings.get(route, no_run)
            answer = prediction(item.event, item.record, meta, score, missing, timing)
            if route is not Route.FULL:
                answer.update(status=route.status, reason=item.reason, degraded_by=route.level)
            value = self._encoder.encode(answer)
            out.append(OutRecord(self.config.output_topic, item.record.key, value))
        return out

    def _count(self, prepared: Prepared) -> None:
        """Outcome counters and end-to-end latency, once the outcomes are written."""
        measure = self.metrics
        now_s = self._clock()
        groups: dict[tuple[str, str | None, str | None], int] = {}
        latencies: dict[str, list[float]] = {}
        for item in prepared.admitted:
            route = item.route
            key = (route.status, route.level, item.reason)
            groups[key] = groups.get(key, 0) + 1
            latencies.setdefault(route.status, []).append(
                max(0.0, now_s - item.record.timestamp_ms / 1000)
            )
            if route is Route.FULL and self.admission.ladder.answer_cache:
                self._answers.put(item.cache_key, item.score, 0.0)
        for (status, level, reason), count in groups.items():
            measure.answered(status, level, reason, count)
        for record, reason in prepared.dead:
            measure.dead_letter(reason)
            latencies.setdefault("DEAD_LETTER", []).append(
                max(0.0, now_s - record.timestamp_ms / 1000)
            )
        for status, seconds in latencies.items():
            metrics.observe_many(measure.end_to_end(status), seconds)

    def _dead_letter(self, record: InputRecord, error: DecodeError) -> OutRecord:
        log.warning(
            "dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, error
        )
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
        "degraded_by": None,
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
