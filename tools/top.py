"""`headrace top`: a live terminal view of running workers, read from their `/metrics`.

Each frame compares two readings of every worker's metrics `interval_s` apart: rates
by outcome status, the end-to-end latency of OK answers (p50, p99, from the histogram's
buckets as Prometheus's `histogram_quantile` interpolates them) against the latency
budget, the share answered OK within the budget, consumer lag, the age of the oldest
unanswered input, batch size, events in flight, and the feature cache's hit rate per
view. Counters are summed over workers; a counter that went down (a restarted worker)
counts from zero. Plain text, so `--once` prints one frame for scripts and tests.
"""

from __future__ import annotations

import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from schemas.errors import HeadraceError

READ_TIMEOUT_S = 3.0


def parse_metrics(text: str) -> list[Sample]:
    """The samples (name, labels, value) of a Prometheus text exposition."""
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def metrics_url(target: str) -> str:
    """`host:port`, or a URL without a path, as the URL of its `/metrics`."""
    url = target if "://" in target else f"http://{target}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


@dataclass
class Reading:
    """Every worker's samples at one moment (monotonic `at_s`); `failed`: url -> why."""

    at_s: float
    samples: dict[str, list[Sample]]
    failed: dict[str, str] = field(default_factory=dict)


def read(urls: Sequence[str], timeout_s: float = READ_TIMEOUT_S) -> Reading:
    """Read each worker's `/metrics` (in turn, each within `timeout_s`)."""
    samples: dict[str, list[Sample]] = {}
    failed: dict[str, str] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                samples[url] = parse_metrics(response.read().decode())
        except (OSError, ValueError) as exc:
            failed[url] = str(getattr(exc, "reason", exc))
    return Reading(time.monotonic(), samples, failed)


@dataclass
class PipelineView:
    name: str
    rates: dict[str, float] = field(default_factory=dict)
    """Outcomes per second by status."""
    p50_s: float | None = None
    p99_s: float | None = None
    budget_s: float | None = None
    in_budget: float | None = None
    """Share of the interval's outcomes (dead letters aside) answered OK within budget."""
    lag: float | None = None
    oldest_s: float | None = None
    batch_size: float | None = None
    """Mean events per batch over the interval."""
    in_flight: float = 0.0
    paused: int = 0
    """Workers whose fetching is paused by backpressure."""
    models: list[str] = field(default_factory=list)


@dataclass
class Frame:
    pipelines: list[PipelineView]
    cache_hit_rates: dict[str, tuple[float, float]]
    """Per feature view: (hit rate, rows per second) over the interval."""
    workers: int
    failed: dict[str, str]
    interval_s: float


STATUSES = ("OK", "DEGRADED", "SHED", "DEAD_LETTER")


def compare(before: Reading, after: Reading) -> Frame:
    """The frame of what happened between two readings."""
    interval_s = max(after.at_s - before.at_s, 1e-9)
    deltas = _Deltas(before, after)
    names = sorted({s.labels["pipeline"] for s in deltas.now if "pipeline" in s.labels})
    views = []
    for name in names:
        view = PipelineView(name)
        counts = deltas.sum_by("headrace_outcomes_total", "status", pipeline=name)
        view.rates = {status: counts.get(status, 0.0) / interval_s for status in STATUSES}
        buckets = deltas.sum_by("headrace_end_to_end_seconds_bucket", "le",
                                pipeline=name, status="OK")  # fmt: skip
        view.p50_s, view.p99_s = quantile(0.5, buckets), quantile(0.99, buckets)
        budgets = deltas.gauge("headrace_latency_budget_seconds", pipeline=name)
        view.budget_s = max(budgets) if budgets else None
        valid = sum(counts.get(status, 0.0) for status in STATUSES if status != "DEAD_LETTER")
        good = deltas.total("headrace_answered_in_budget_total", pipeline=name)
        # Both are counted per batch, a scrape may fall between them: at most 100%.
        view.in_budget = min(1.0, good / valid) if valid else None
        lags = deltas.gauge("headrace_consumer_lag_records", pipeline=name)
        view.lag = sum(lags) if lags else None
        oldest = deltas.gauge("headrace_oldest_unanswered_seconds", pipeline=name)
        view.oldest_s = max(oldest) if oldest else None
        batches = deltas.total("headrace_batch_size_count", pipeline=name)
        events = deltas.total("headrace_batch_size_sum", pipeline=name)
        view.batch_size = events / batches if batches else None
        view.in_flight = sum(deltas.gauge("headrace_in_flight_events", pipeline=name))
        view.paused = sum(1 for v in deltas.gauge("headrace_fetch_paused", pipeline=name) if v)
        models = {
            (s.labels.get("role") != "full", s.labels["model"], s.labels["version"],
             s.labels.get("role"))
            for s in deltas.now
            if s.name == "headrace_model_info" and s.labels.get("pipeline") == name and s.value
        }  # fmt: skip
        view.models = [
            f"{model} v{version}" + ("" if role == "full" else f" ({role})")
            for _, model, version, role in sorted(models)
        ]
        views.append(view)
    hits = deltas.sum_by("headrace_feature_cache_hits_total", "view")
    misses = deltas.sum_by("headrace_feature_cache_misses_total", "view")
    caches = {}
    for view_name in sorted(set(hits) | set(misses)):
        rows = hits.get(view_name, 0.0) + misses.get(view_name, 0.0)
        if rows:
            caches[view_name] = (hits.get(view_name, 0.0) / rows, rows / interval_s)
    return Frame(views, caches, len(after.samples), after.failed, interval_s)


class _Deltas:
    """Counter increases between two readings, summed over workers, and the gauges of
    the later one."""

    def __init__(self, before: Reading, after: Reading) -> None:
        self.now = [s for samples in after.samples.values() for s in samples]
        self._increase: list[tuple[Sample, float]] = []
        for url, samples in after.samples.items():
            earlier = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for s in before.samples.get(url, [])
            }
            for sample in samples:
                was = earlier.get((sample.name, tuple(sorted(sample.labels.items()))), 0.0)
                # A counter that went down belongs to a restarted worker: count from zero.
                increase = sample.value - was if sample.value >= was else sample.value
                self._increase.append((sample, increase))

    def _matching(self, name: str, labels: dict[str, str]) -> Iterable[tuple[Sample, float]]:
        return (
            (s, increase) for s, increase in self._increase
            if s.name == name and labels.items() <= s.labels.items()
        )  # fmt: skip

    def total(self, name: str, **labels: str) -> float:
        return sum(increase for _, increase in self._matching(name, labels))

    def sum_by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        found: dict[str, float] = defaultdict(float)
        for sample, increase in self._matching(name, labels):
            found[sample.labels.get(label, "")] += increase
        return dict(found)

    def gauge(self, name: str, **labels: str) -> list[float]:
        return [s.value for s, _ in self._matching(name, labels)]


def quantile(q: float, buckets: dict[str, float]) -> float | None:
    """`histogram_quantile` over cumulative bucket counts by `le` (None: no events).
    Linear within a bucket; a rank in the +Inf bucket answers the highest finite bound."""
    bounds = sorted((float(le), count) for le, count in buckets.items())
    if not bounds or bounds[-1][1] <= 0:
        return None
    rank = q * bounds[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if bound == float("inf"):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def render(frame: Frame, sources: Sequence[str], clock: Callable[[], float] = time.time) -> str:
    """One frame as plain text."""
    stamp = time.strftime("%H:%M:%S", time.localtime(clock()))
    lines = [
        f"headrace top  {stamp}  {frame.workers} worker(s) read over "
        f"{frame.interval_s:.1f} s: {', '.join(sources)}",
        "",
    ]
    header = (
        *("PIPELINE", "OK/s", "DEGRADED/s", "SHED/s", "DEAD/s", "P50 ms", "P99 ms"),
        *("BUDGET ms", "IN BUDGET", "LAG", "OLDEST s", "BATCH", "IN FLIGHT", "MODEL"),
    )
    rows = [header]
    for view in frame.pipelines:
        rows.append((
            view.name,
            *(f"{view.rates[status]:.1f}" for status in STATUSES),
            _ms(view.p50_s), _ms(view.p99_s) + _over(view.p99_s, view.budget_s),
            _ms(view.budget_s),
            "-" if view.in_budget is None else f"{100 * view.in_budget:.2f}%",
            "-" if view.lag is None else f"{view.lag:.0f}",
            "-" if view.oldest_s is None else f"{view.oldest_s:.1f}",
            "-" if view.batch_size is None else f"{view.batch_size:.1f}",
            f"{view.in_flight:.0f}" + (f" (paused: {view.paused})" if view.paused else ""),
            ", ".join(view.models) or "-",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    if not frame.pipelines:
        lines.append("(no pipeline metrics yet)")
    if frame.cache_hit_rates:
        lines += ["", "feature cache (hit rate, rows/s):"]
        width = max(len(name) for name in frame.cache_hit_rates)
        for name, (rate, rows_per_s) in frame.cache_hit_rates.items():
            lines.append(f"  {name.ljust(width)}  {100 * rate:5.1f}%  {rows_per_s:8.1f}")
    for url, why in frame.failed.items():
        lines.append(f"unreachable: {url} ({why})")
    return "\n".join(line.rstrip() for line in lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def _over(seconds: float | None, budget_s: float | None) -> str:
    return " !" if seconds is not None and budget_s is not None and seconds > budget_s else ""


class NoWorkerAnswered(HeadraceError):
    """`top --once`: not one target's /metrics answered."""

    exit_status = 69  # EX_UNAVAILABLE, as for an unreachable broker


def frames(urls: Sequence[str], interval_s: float) -> Iterable[Frame]:
    """Frames, one per `interval_s`, for as long as the caller iterates."""
    before = read(urls)
    while True:
        time.sleep(max(0.0, before.at_s + interval_s - time.monotonic()))
        after = read(urls)
        yield compare(before, after)
        before = after
