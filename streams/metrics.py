"""Prometheus metrics of the worker, served on `/metrics`.

Labels are bounded: pipeline names come from the config, outcomes, stages and
reasons from fixed sets in the code.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

from features.metrics import SECONDS_BUCKETS

# Feast's import sets prometheus-client's multiprocess variable, and then every label
# removal warns; a worker is one process. Set once here: `catch_warnings` around each
# removal would change the process-wide filters from several threads.
warnings.filterwarnings("ignore", message="Removal of labels", category=UserWarning)

OUTCOMES = Counter(
    "headrace_outcomes",
    "Input events by the outcome written for them: status OK, DEGRADED, SHED or DEAD_LETTER, "
    "with the reason (empty for OK; the reason code for DEAD_LETTER). Reconciles with "
    "`headrace audit`.",
    ["pipeline", "status", "reason"],
)
SHED = Counter("headrace_shed_events", "Events answered SHED, by reason.", ["pipeline", "reason"])
DEGRADED = Counter(
    "headrace_degraded_events",
    "Events answered DEGRADED, by the rung that answered (level) and reason.",
    ["pipeline", "level", "reason"],
)
ESTIMATED_COMPLETION = Gauge(
    "headrace_estimated_completion_seconds",
    "The latest estimate, used by admission (at release) or before inference, of the "
    "seconds until an answer is written: path full (a batch with one event for the full "
    "model; admission scales it by the batch's count) or fallback.",
    ["pipeline", "path", "check"],
)
GC_PAUSE_SECONDS = Histogram(
    "headrace_gc_pause_seconds",
    "Pauses of Python's garbage collector, by generation (2 is a full collection): "
    "every event in flight waits through one.",
    ["generation"],
    buckets=SECONDS_BUCKETS,
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
    "From the input record's Kafka timestamp to its outcome being acknowledged by Kafka, "
    "by the outcome's status.",
    ["pipeline", "status"],
    buckets=SECONDS_BUCKETS,
)
ADMISSION_LAG_SECONDS = Histogram(
    "headrace_admission_lag_seconds",
    "Event-time lag at admission: from the input's Kafka timestamp to its batch being "
    "admitted (time spent in Kafka, the consumer and the batcher).",
    ["pipeline"],
    buckets=SECONDS_BUCKETS,
)
BATCH_SIZE = Histogram(
    "headrace_batch_size",
    "Events per micro-batch.",
    ["pipeline"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
)
ANSWERED_BEFORE = Counter(
    "headrace_answered_before",
    "Inputs read again after a worker stopped before committing them, found already "
    "answered in the outcome topics and not answered twice (`streams/replay.py`).",
    ["pipeline"],
)
LEFT_OUT = Counter(
    "headrace_answers_left_out",
    "Answers made but never written: exactly-once left them out of its transactions, the "
    "group having taken their input partitions away first (a lapsed session); their next "
    "owner answers those inputs. headrace_outcomes_total counts them too.",
    ["pipeline"],
)
REDELIVERED = Counter(
    "headrace_redelivered",
    "Inputs read again after a handover whose check could not see an earlier answer, "
    "answered with the headrace.redelivered header (`streams/replay.py`).",
    ["pipeline"],
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
REGISTRY_STALLED = Gauge(
    "headrace_registry_stalled_partitions",
    "Input partitions waiting for the schema registry (a schema id lookup failed).",
    ["pipeline"],
)
REGISTRY_LOOKUP_FAILURES = Counter(
    "headrace_registry_lookup_failures",
    "Schema id lookups that failed (registry unreachable), each retried with backoff.",
    ["pipeline"],
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
CONSUMER_LAG = Gauge(
    "headrace_consumer_lag_records",
    "Records of an input partition this worker holds that it has not answered: the "
    "partition's high-water mark minus the first offset read and not answered (or the next "
    "to read). At rest: Kafka's consumer-group lag (streams/lag.py).",
    ["pipeline", "topic", "partition"],
)
OLDEST_UNANSWERED = Gauge(
    "headrace_oldest_unanswered_seconds",
    "Age, from its Kafka timestamp, of the oldest input read and not yet answered (0: none).",
    ["pipeline"],
)
ANSWERED_IN_BUDGET = Counter(
    "headrace_answered_in_budget",
    "Inputs answered OK by their deadline (event time plus the latency budget): the good "
    "events of the SLO, out of every outcome but DEAD_LETTER.",
    ["pipeline"],
)
LATENCY_BUDGET = Gauge(
    "headrace_latency_budget_seconds", "The pipeline's latency budget.", ["pipeline"]
)
MODEL_INFO = Gauge(
    "headrace_model_info",
    "1 for each model a pipeline runs: role full or fallback, its name and version.",
    ["pipeline", "role", "model", "version"],
)


MODEL_CHANGES = Counter(
    "headrace_model_changes",
    "Deployments a worker acted on: applied, refused (did not load or validate), "
    "rolled_back (a guardrail broke).",
    ["pipeline", "outcome"],
)
SERVING_VERSION = Gauge(
    "headrace_serving_version_info",
    "1 for each model version a pipeline answers with now, by role (serving, canary, shadow).",
    ["pipeline", "role", "version"],
)
SHADOW_ANSWERS = Counter(
    "headrace_shadow_answers",
    "A shadow candidate's answers: written to the shadow topic, skipped (it fell "
    "behind: its queue was full), failed (it could not score or write them).",
    ["pipeline", "result"],
)
MODEL_RUN_SECONDS = Histogram(
    "headrace_model_run_seconds",
    "Wall time of one model run (a batch, or a canary's share of it), by model version: "
    "a serving version and its candidate side by side.",
    ["pipeline", "version"],
    buckets=SECONDS_BUCKETS,
)
MODEL_ANSWERS = Counter(
    "headrace_model_answers",
    "Answers a model version computed: ok, or error (not a number: the event took the "
    "ladder instead). Shadow answers count too.",
    ["pipeline", "version", "result"],
)
MODEL_SCORE_SUM = Counter(
    "headrace_model_score_sum",
    "Sum of a version's ok answers' scores (value, for regression): over "
    'headrace_model_answers_total{result="ok"}, its running mean score.',
    ["pipeline", "version"],
)
MODEL_ROLLBACKS = Counter(
    "headrace_model_rollbacks",
    "Candidates a guardrail rolled back, by the limit broken (latency, errors, "
    "score_drift); counted by the worker that decided.",
    ["pipeline", "reason"],
)


def remove(metric, *labels: str) -> None:
    """Stop exporting `metric`'s child of `labels` (nothing when it has none): a version
    that left its pipeline must not leave a series behind for every deploy."""
    with contextlib.suppress(KeyError):  # older prometheus-client raises for an absent one
        metric.remove(*labels)


class PipelineMetrics:
    """The children of one pipeline's metrics, bound once (`labels()` costs more than
    an observation on the per-event path)."""

    def __init__(self, pipeline: str) -> None:
        self.pipeline = pipeline
        self.admission_lag = ADMISSION_LAG_SECONDS.labels(pipeline)
        self.batch_size = BATCH_SIZE.labels(pipeline)
        self.answered_before = ANSWERED_BEFORE.labels(pipeline)
        self.redelivered = REDELIVERED.labels(pipeline)
        self.stage = {
            stage: STAGE_SECONDS.labels(pipeline, stage)
            for stage in ("decode", "features", "inference", "encode", "publish")
        }
        self._children: dict[tuple, object] = {}

    def _child(self, metric, *labels: str):
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.pipeline, *labels)
        return child

    def end_to_end(self, status: str) -> Histogram:
        return self._child(END_TO_END_SECONDS, status)

    def in_budget(self, count: int) -> None:
        """Count `count` inputs answered OK by their deadline."""
        if count:
            self._child(ANSWERED_IN_BUDGET).inc(count)

    def describe(self, budget_s: float, models: dict[str, tuple[str, str]]) -> None:
        """Export the latency budget and the models (role -> (name, version)); start the
        SLO's good-event counter at 0, so a ratio over it exists before the first one."""
        self._child(LATENCY_BUDGET).set(budget_s)
        self._child(ANSWERED_IN_BUDGET)
        for role, (name, version) in models.items():
            self._child(MODEL_INFO, role, name, version).set(1)

    def switched(self, role: str, old: tuple[str, str], new: tuple[str, str]) -> None:
        """`role`'s model is now `new` (name, version): its info series replaces `old`'s."""
        if old == new:
            return
        self._children.pop((MODEL_INFO, role, *old), None)
        with contextlib.suppress(KeyError):  # never exported
            MODEL_INFO.remove(self.pipeline, role, *old)
        self._child(MODEL_INFO, role, *new).set(1)

    def missing_features(self, view: str) -> Counter:
        return self._child(MISSING_FEATURES, view)

    def dead_letter(self, reason: str) -> None:
        self._child(DEAD_LETTERS, reason).inc()
        self._child(OUTCOMES, "DEAD_LETTER", reason).inc()

    def answered(self, status: str, level: str | None, reason: str | None, count: int) -> None:
        """Count `count` events answered with `status` (not dead letters)."""
        self._child(OUTCOMES, status, reason or "").inc(count)
        if status == "SHED":
            self._child(SHED, reason or "").inc(count)
        elif status == "DEGRADED":
            self._child(DEGRADED, level or "", reason or "").inc(count)

    def estimate(self, path: str, check: str) -> Gauge:
        return self._child(ESTIMATED_COMPLETION, path, check)


def observe_many(histogram: Histogram, amounts: Sequence[float]) -> None:
    """`histogram.observe(a)` for every a, at one increment per bucket touched.

    A per-event `observe` takes a lock per call and walks the buckets; per batch this
    counts each bucket once (prometheus-client's bucket and sum values, stable across
    the versions headrace pins; per-value `observe` where they are missing).
    """
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    if buckets is None or bounds is None or len(buckets) != len(bounds):
        for amount in amounts:
            histogram.observe(amount)
        return
    if not amounts:
        return
    # Bucket i counts amounts <= bounds[i] and above the bound before it, like `observe`.
    if len(amounts) <= 2:  # light load: a tally costs more than two increments
        for amount in amounts:
            buckets[bisect_left(bounds, amount)].inc(1)
    else:
        for index, count in Tally(bisect_left(bounds, amount) for amount in amounts).items():
            buckets[index].inc(count)
    histogram._sum.inc(sum(amounts))


# (HTTP status, body) for a path it answers, None for the others.
ExtraRoutes = Callable[[str], tuple[int, str] | None]


def serve_metrics(port: int, extra: ExtraRoutes = lambda path: None) -> None:
    """Serve `/metrics`, and the paths `extra` answers (health), from daemon threads
    (one per request: a slow check does not hold up a scrape); port 0: no endpoint.
    OSError when the port is taken."""
    if not port:
        return
    # A render holds the interpreter lock the pipeline needs, for microseconds per sample.
    # The `_created` samples (a start time per counter and histogram child, a tenth of
    # all) are read by nothing here: not rendered.
    disable_created_metrics()
    prometheus = make_wsgi_app()

    def app(environ, start_response):
        answer = extra(environ.get("PATH_INFO", ""))
        if answer is None:
            return prometheus(environ, start_response)
        status, body = answer
        reason = "OK" if status == 200 else "Service Unavailable"
        start_response(f"{status} {reason}", [("Content-Type", "text/plain; charset=utf-8")])
        return [body.encode()]

    server = make_server("", port, app, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # no line per scrape or probe
        pass
