"""The worker's configuration: one YAML file, validated into frozen pydantic models.

Relative paths in the file are resolved against the file's own folder, so a config
works from any current directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from features.config import FeatureCacheConfig, FeaturesConfig
from models.config import ModelConfig
from schemas.config import FrozenModel as _Frozen
from schemas.config import InputConfig, RegistryConfig
from streams.errors import ConfigError

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_AVRO_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class BrokerConfig(_Frozen):
    bootstrap_servers: str = Field("127.0.0.1:9092", min_length=1)
    """Comma-separated host:port list of the Kafka brokers."""
    fetch_max_wait_ms: int | None = Field(None, ge=0, le=1000)
    """Longest a fetch waits at the broker for `fetch_min_bytes`: more records per fetch
    (less CPU per event, in the worker and the broker) for at most this much latency.
    Unset: the runtime's own (`fetching`)."""
    fetch_min_bytes: int | None = Field(None, ge=1, le=50_000_000)
    """Bytes a fetch waits for (up to `fetch_max_wait_ms`) before the broker answers.
    Unset: the runtime's own (`fetching`)."""
    max_partition_fetch_bytes: int = Field(1_048_576, ge=1_024, le=1_000_000_000)
    """Bytes one fetch asks of each partition (both runtimes). A larger record is still
    fetched, whole and alone (brokers return a fetch's first record batch whatever its
    size), so this bounds what a fetch buffers, not the largest input."""
    fetch_max_bytes: int = Field(52_428_800, ge=1_000_000, le=1_000_000_000)
    """Bytes one fetch asks in all, over its partitions (same exception; librdkafka
    wants at least 1,000,000)."""
    max_message_bytes: int | None = Field(None, ge=1_024, le=1_000_000_000)
    """Largest record batch the worker writes to any topic. None (default): each output
    and dead-letter topic's own `max.message.bytes`, read from Kafka at start; set it
    where the worker may not read topic configs."""
    connect_timeout_ms: int = Field(5_000, ge=1_000, le=300_000)
    """How long a command (worker, audit, produce, ...) waits at start for the brokers to
    answer before it reports them unreachable (exit 69); also the longest one connection
    attempt of a client may take."""

    session_timeout_ms: int = Field(6_000, ge=6_000, le=300_000)
    """How long the group waits for a worker that stopped heartbeating (killed, frozen)
    before its partitions go to the others; a restarted worker waits this long at most
    to get them back (the clients' defaults are 45 s and, on Faust, 60 s)."""

    @property
    def heartbeat_interval_ms(self) -> int:
        """A fifth of the session, on both runtimes: a member is dropped after missing
        about five heartbeats, and one whose last came just before it froze, one
        interval sooner."""
        return self.session_timeout_ms // 5

    instance_id: str | None = Field(None, min_length=1, max_length=249)
    """Static group membership: a name unique to this worker and stable across its
    restarts (e.g. a StatefulSet pod's name). A worker restarted within
    `session_timeout_ms` then takes its partitions back at once, with no rebalance.
    Two live workers with one name fence each other: leave it unset when unsure."""
    commit_interval_ms: int = Field(100, ge=0, le=60_000)
    """How often answered offsets are committed: what a crash can make the next worker
    read again (a rebalance or a clean stop commits first and repeats nothing). 0
    commits each batch's offsets as soon as it is acknowledged: one commit at a time,
    the batches acknowledged meanwhile in the next."""
    metadata_refresh_ms: int = Field(10_000, ge=1_000, le=300_000)
    """How often a worker's consumer reads its input topics' metadata again: partitions
    added to an input topic are served after at most this, plus a rebalance (the
    clients' default is five minutes, all that time unserved)."""
    replay_lookback_s: float = Field(120.0, ge=0, le=3_600)
    """At each assignment, how far back the outcome topics are read for inputs past the
    committed offsets that a crashed worker already answered (not answered again,
    `streams/replay.py`); 0 reads nothing back: those inputs are answered again, marked
    `headrace.redelivered`."""

    @property
    def connect_timeout_s(self) -> float:
        return self.connect_timeout_ms / 1000

    def fetching(self, runtime: str) -> tuple[int, int]:
        """(fetch_max_wait_ms, fetch_min_bytes): those set, else the runtime's own
        (`RUNTIME_FETCH`)."""
        wait_ms, min_bytes = RUNTIME_FETCH[runtime]
        return (
            wait_ms if self.fetch_max_wait_ms is None else self.fetch_max_wait_ms,
            min_bytes if self.fetch_min_bytes is None else self.fetch_min_bytes,
        )


# Each runtime's fetch settings where the config sets none. Bare: every fetch answered
# on its first byte (Kafka's own default; librdkafka cannot change its wait while it
# runs). On two cores that took 3 ms off its p50 at light load and most of what an idle
# worker costs the broker, for up to twice the CPU per event below the limit and, in
# some runs, up to a third of the limit (README, "Latency first, on both runtimes").
# Faust: what a busy fetch waits for, from 3,200 events/s at these settings; it answers
# idle and lighter-load fetches on their first byte (`streams/consumers/faust_feed.py`).
RUNTIME_FETCH: dict[str, tuple[int, int]] = {"bare": (500, 1), "faust": (5, 16_384)}


class PriorityConfig(_Frozen):
    """Where an event's priority comes from; higher numbers are more important."""

    header: str | None = Field("headrace-priority", min_length=1)
    """Record header holding the priority as a decimal integer (None: not read)."""
    field: str | None = Field(None, min_length=1)
    """Event field holding the priority, used when the header is absent (None: not read)."""
    default: int = Field(1, ge=0)
    """Priority of an event that carries none (or an unreadable one)."""
    budget_shares: list[float] = Field([0.5, 1.0], min_length=1, max_length=16)
    """Per priority (index 0 is the lowest), the share of the latency budget its events
    may use; values beyond the list are clamped to it. Under overload, events of a lower
    share degrade and shed first. The default: 0 (low) gets half, 1 (normal, the default
    priority) and above the whole budget; e.g. `[0.4, 0.7, 1.0]` makes 2 a high priority
    that normal traffic yields to."""

    @field_validator("budget_shares")
    @classmethod
    def _shares(cls, shares: list[float]) -> list[float]:
        if not all(0 < share <= 1 for share in shares):
            raise ValueError(f"each share must be in (0, 1], got {shares}")
        if shares != sorted(shares):
            raise ValueError(f"shares must not decrease with priority, got {shares}")
        return shares

    @model_validator(mode="after")
    def _default_in_range(self) -> PriorityConfig:
        if self.default >= len(self.budget_shares):
            raise ValueError(
                f"default priority {self.default} has no budget share "
                f"(priorities 0..{len(self.budget_shares) - 1})"
            )
        return self


class AnswerCacheConfig(_Frozen):
    max_entries: int = Field(10_000, ge=0, le=10_000_000)
    """Recent full-model answers kept (LRU), keyed by the event's model inputs and entity
    keys; 0 turns the cache rung off."""
    max_age_s: float = Field(60.0, gt=0, le=86_400)
    """Oldest answer that may be served again."""


class DegradationConfig(_Frozen):
    """The ladder for events the full model cannot answer in time, tried in this order;
    an event no rung can answer gets a SHED record."""

    fallback_model: ModelConfig | None = None
    """A cheaper model (`headrace models train` writes `fraud-lite.onnx`); used while it
    can still meet the event's deadline."""
    answer_cache: AnswerCacheConfig = AnswerCacheConfig()
    default_score: float | None = None
    """A fixed answer for whatever is left: the score of a binary model, the value of a
    regression (None: shed instead; a multiclass model has no default answer)."""
    store_timeout_ms: float | None = Field(None, gt=0, le=60_000)
    """Longest a batch's feature read may take before its events answer without the
    store (None: half the latency budget). Failed or too-slow reads open a circuit
    breaker: reads stop for a second, then one probe read tests the store again."""


class OutputConfig(_Frozen):
    """The answer records: their schema is derived from the pipeline (`headrace schema
    show`), registered under `<output_topic>-value` with a registry."""

    include: list[str] | None = None
    """Input fields copied into every answer (None: the input's event_id_field, if any)."""
    record_name: str = Field("Prediction", pattern=_AVRO_NAME)
    namespace: str = Field("headrace.predictions", pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")


class PipelineConfig(_Frozen):
    name: str = Field(pattern=_NAME)
    input_topic: str = Field(pattern=_NAME)
    output_topic: str = Field(pattern=_NAME)
    dead_letter_topic: str = Field(pattern=_NAME)
    input: InputConfig
    feature_service: str | None = Field(None, min_length=1)
    """The Feast feature service read for each event (None: the model needs only event
    fields)."""
    entity_fields: dict[str, str] = Field(default_factory=dict)
    """Feast join key -> the event field that carries it."""
    feature_cache: FeatureCacheConfig = FeatureCacheConfig()
    model: ModelConfig
    output: OutputConfig = OutputConfig()
    max_batch_size: int = Field(64, ge=1, le=4096)
    """Most events in one micro-batch (one Feast read, one ONNX run)."""
    shadow_topic: str | None = Field(None, pattern=_NAME)
    """Where a candidate deployed `--shadow` publishes its answers (None:
    `<output_topic>-shadow`)."""
    max_wait_ms: float = Field(2.0, ge=0, le=10_000)
    """Longest the first event of a batch waits for the batch to fill."""
    batching: Literal["adaptive", "fixed"] = "adaptive"
    """`adaptive`: a batch is full at the smallest size that keeps up with the arrival
    rate (small batches when traffic is light); `fixed`: full at `max_batch_size`."""
    latency_budget_ms: float = Field(100.0, gt=0, le=3_600_000)
    """An event's deadline is its event time (`input.event_time_field`, else the Kafka
    timestamp) plus this budget."""
    priority: PriorityConfig = PriorityConfig()
    degradation: DegradationConfig = DegradationConfig()
    max_in_flight: int = Field(2_000, ge=1, le=1_000_000)
    """Consumed but unacknowledged events at which fetching pauses (the memory bound)."""
    resume_in_flight: int | None = Field(None, ge=0)
    """Fetching resumes when in-flight events drain to this; default half of max_in_flight."""

    @model_validator(mode="after")
    def _features(self) -> PipelineConfig:
        if self.feature_service is not None and not self.entity_fields:
            raise ValueError("feature_service needs entity_fields (Feast join key -> event field)")
        return self

    @model_validator(mode="after")
    def _water_marks(self) -> PipelineConfig:
        if self.resume_in_flight is not None and self.resume_in_flight >= self.max_in_flight:
            raise ValueError(
                f"resume_in_flight ({self.resume_in_flight}) must be below "
                f"max_in_flight ({self.max_in_flight})"
            )
        return self

    @property
    def included_fields(self) -> list[str]:
        """Input fields copied into answers."""
        if self.output.include is not None:
            return self.output.include
        return [self.input.event_id_field] if self.input.event_id_field else []

    @property
    def shadow_output_topic(self) -> str:
        return self.shadow_topic or f"{self.output_topic}-shadow"

    @property
    def resume_at(self) -> int:
        return self.max_in_flight // 2 if self.resume_in_flight is None else self.resume_in_flight


class MetricsConfig(_Frozen):
    port: int = Field(9108, ge=0, le=65_535)
    """Port of the Prometheus `/metrics` endpoint on all interfaces, which also serves
    `/healthz/live` and `/healthz/ready`; 0 turns it off."""


class HealthConfig(_Frozen):
    """What `/healthz/live` tolerates before it answers 503 (README, "Health")."""

    stall_after_s: float = Field(30.0, gt=0, le=3_600)
    """Records waiting this long with no batch acknowledged (held for the registry
    excepted) make the worker not live: its pipeline is stuck."""
    loop_timeout_ms: float = Field(1_000, gt=0, le=60_000)
    """The event loop must run a callback within this; longer means it is blocked."""


class TracingConfig(_Frozen):
    """OpenTelemetry tracing: the W3C `traceparent` of each input is continued by a span
    per batch stage, and every answer and dead letter carries one on to its consumer."""

    enabled: bool = False
    """Off: no header is read or written and no span is made (nothing on the hot path)."""
    exporter: Literal["zipkin", "otlp"] = "zipkin"
    """`zipkin`: Zipkin's JSON v2 API; `otlp`: OTLP protobuf over HTTP (a collector,
    Jaeger, Tempo)."""
    endpoint: str | None = Field(None, min_length=1)
    """Where spans go; None: the exporter's local default
    (`http://127.0.0.1:9411/api/v2/spans`, `http://127.0.0.1:4318/v1/traces`)."""
    sample_ratio: float = Field(1.0, ge=0, le=1)
    """Share of new traces recorded; an input that carries a trace follows its sampled
    flag (parent-based sampling)."""
    service_name: str | None = Field(None, min_length=1)
    """The service the spans name; None: the config's `app_id`."""
    export_timeout_ms: int = Field(5_000, ge=100, le=60_000)
    """Longest one export request may take (spans are sent by a background thread)."""


class ControlConfig(_Frozen):
    """The model control plane (`headrace models deploy|promote|rollback|status`)."""

    topic: str = Field("headrace-control", pattern=_NAME)
    """Compacted topic holding each pipeline's desired deployment (the serving version,
    a candidate in canary or shadow); every worker follows it. Created when missing."""
    status_topic: str = Field("headrace-control-status", pattern=_NAME)
    """Compacted topic where each worker reports what it applied (its heartbeat)."""
    heartbeat_interval_s: float = Field(5.0, gt=0, le=3_600)
    """How often a worker reports; `status` calls a worker silent for 3 of these gone."""


class HeadraceConfig(_Frozen):
    app_id: str = Field("headrace", pattern=_NAME)
    """Faust app id; also the Kafka consumer group of the workers."""
    runtime: Literal["faust", "bare"] = "faust"
    """`faust`: Faust agents consume; `bare`: a confluent-kafka consumer feeds the same
    batcher and stages without Faust (leaner; see the benchmark for the difference)."""
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """The asyncio event loop implementation: uvloop (faster hand-offs) or the standard one."""
    delivery: Literal["at_least_once", "exactly_once"] = "at_least_once"
    """`at_least_once`: a batch's offsets are committed once its outcomes are written
    (a crash can make the next worker answer the uncommitted ones again);
    `exactly_once`: a batch's outcomes and its offsets are committed in one Kafka
    transaction (consumers read with isolation.level=read_committed)."""
    broker: BrokerConfig = BrokerConfig()
    registry: RegistryConfig | None = None
    """Without a registry, schema ids resolve from the local catalogue in `schemas/`."""
    features: FeaturesConfig = FeaturesConfig()
    metrics: MetricsConfig = MetricsConfig()
    control: ControlConfig = ControlConfig()
    tracing: TracingConfig = TracingConfig()
    log_format: Literal["text", "json"] = "text"
    """`json`: one JSON object per log line, with the pipeline, partition, offsets and
    trace id where the line concerns records."""
    health: HealthConfig = HealthConfig()
    drain_timeout_s: float = Field(20.0, gt=0, le=3_600)
    """On SIGTERM a worker stops fetching, answers and commits what it holds and leaves
    its group within this; past it, it exits (status 70) and the next owner answers
    what was left. Keep Kubernetes' terminationGracePeriodSeconds above it."""
    pipelines: list[PipelineConfig] = Field(min_length=1)

    @field_validator("pipelines")
    @classmethod
    def _distinct(cls, pipelines: list[PipelineConfig]) -> list[PipelineConfig]:
        for attr in ("name", "input_topic"):
            seen = [getattr(p, attr) for p in pipelines]
            duplicates = sorted({v for v in seen if seen.count(v) > 1})
            if duplicates:
                raise ValueError(f"each pipeline needs its own {attr}; repeated: {duplicates}")
        return pipelines


def parse_config(data: object, source: str, base_dir: Path | None = None) -> HeadraceConfig:
    """Validate already-loaded data; errors name `source` and each failing field."""
    try:
        return HeadraceConfig.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or '(top level)'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ConfigError(f"{source}: {problems}") from exc


def load_config(path: Path) -> HeadraceConfig:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "hint: save the config as UTF-8"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(data, str(path), path.resolve().parent)
