"""Prometheus metrics of the worker, served on `/metrics`.

Labels are bounded: pipeline names come from the config, outcomes, stages and
reasons from fixed sets in the code.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from features.metrics import SECONDS_BUCKETS

EVENTS = Counter(
    "headrace_events",
    "Input events by outcome: prediction (status OK) or dead_letter.",
    ["pipeline", "outcome"],
)
DEAD_LETTERS = Counter(
    "headrace_dead_letters", "Dead-lettered events by reason code.", ["pipeline", "reason"]
)
MISSING_FEATURES = Counter(
    "headrace_missing_feature_rows",
    "Events scored with model defaults because a view had no row for their entity.",
    ["pipeline", "view"],
)
STAGE_SECONDS = Histogram(
    "headrace_stage_seconds",
    "Wall time of a stage for one batch (decode and encode: the whole batch).",
    ["pipeline", "stage"],
    buckets=SECONDS_BUCKETS,
)
END_TO_END_SECONDS = Histogram(
    "headrace_end_to_end_seconds",
    "From the input record's Kafka timestamp to its outcome being acknowledged by Kafka.",
    ["pipeline"],
    buckets=SECONDS_BUCKETS,
)
ADMISSION_LAG_SECONDS = Histogram(
    "headrace_admission_lag_seconds",
    "From the input record's Kafka timestamp to its batch entering the pipeline "
    "(time spent in Kafka, the consumer and the batcher).",
    ["pipeline"],
    buckets=SECONDS_BUCKETS,
)
BATCH_SIZE = Histogram(
    "headrace_batch_size",
    "Events per micro-batch.",
    ["pipeline"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
)
RETRIES = Counter(
    "headrace_batch_retries", "Batches retried after a store, model or Kafka error.", ["pipeline"]
)


IN_FLIGHT = Gauge(
    "headrace_in_flight_events", "Events consumed and not yet acknowledged.", ["pipeline"]
)
PAUSED = Gauge("headrace_fetch_paused", "1 while fetching is paused by backpressure.", ["pipeline"])
PAUSES = Counter(
    "headrace_fetch_pauses", "Times fetching was paused at the in-flight bound.", ["pipeline"]
)
QUEUE_SECONDS = Histogram(
    "headrace_batch_queue_seconds",
    "Wait of a released batch for its next stage (features, inference or publish).",
    ["pipeline", "stage"],
    buckets=SECONDS_BUCKETS,
)
BATCH_TARGET = Gauge(
    "headrace_batch_target_size", "The size at which the batcher counts a batch full.", ["pipeline"]
)


class PipelineMetrics:
    """The children of one pipeline's metrics, bound once (`labels()` costs more than
    an observation on the per-event path)."""

    def __init__(self, pipeline: str) -> None:
        self.pipeline = pipeline
        self.admission_lag = ADMISSION_LAG_SECONDS.labels(pipeline)
        self.end_to_end = END_TO_END_SECONDS.labels(pipeline)
        self.batch_size = BATCH_SIZE.labels(pipeline)
        self.stage = {
            stage: STAGE_SECONDS.labels(pipeline, stage)
            for stage in ("decode", "features", "inference", "encode", "publish")
        }
        self.predictions = EVENTS.labels(pipeline, "prediction")
        self.dead_letters = EVENTS.labels(pipeline, "dead_letter")

    def missing_features(self, view: str):
        return MISSING_FEATURES.labels(self.pipeline, view)

    def dead_letter_reason(self, reason: str):
        return DEAD_LETTERS.labels(self.pipeline, reason)


def serve_metrics(port: int) -> None:
    """Serve `/metrics` from a daemon thread; port 0 means no endpoint."""
    if port:
        start_http_server(port)
