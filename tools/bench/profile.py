"""Where a worker's time goes per event, from its own `/metrics` stage histograms.

Two scrapes bracket a benchmark step; the differences of the histogram sums and
counts give the mean time per event of each stage over that step.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

STAGES = ("decode", "features", "inference", "encode", "publish")

Scrape = dict[str, float]


def scrape(port: int) -> Scrape:
    """Sums and counts of the worker's histograms and its event counter, flattened."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if name == "headrace_outcomes_total":
                values["events"] += sample.value
            elif name in ("headrace_stage_seconds_sum", "headrace_stage_seconds_count"):
                values[f"{labels['stage']}_{name.rsplit('_', 1)[1]}"] += sample.value
            elif name.endswith(("_sum", "_count")) and name.startswith(
                ("headrace_admission_lag_seconds", "headrace_end_to_end_seconds",
                 "headrace_batch_size")
            ):  # fmt: skip
                values[name.removeprefix("headrace_")] += sample.value
    return dict(values)


def stage_profile(before: Scrape, after: Scrape) -> dict[str, float]:
    """Mean µs per event of each stage between two scrapes, plus batch figures."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    events = delta("events")
    if events <= 0:
        return {}
    batches = delta("batch_size_count")
    profile = {
        "events": events,
        "batches": batches,
        "mean_batch_size": delta("batch_size_sum") / batches if batches else 0.0,
        "queueing_us": delta("admission_lag_seconds_sum") / events * 1e6,
    }
    for stage in STAGES:
        profile[f"{stage}_us"] = delta(f"{stage}_sum") / events * 1e6
    profile["worker_total_us"] = delta("end_to_end_seconds_sum") / events * 1e6
    return profile
