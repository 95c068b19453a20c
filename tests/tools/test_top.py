"""`headrace top`: frames from two readings of workers' metrics, and one frame from a
live worker (`--once`)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import pytest
from prometheus_client.samples import Sample

from infra.ports import free_port
from tests.helpers import PATIENT_BUDGET_MS, produce_events, scrape, total, wait_until
from tools.top import Reading, compare, metrics_url, quantile, render


def sample(name: str, value: float, **labels: str) -> Sample:
    return Sample(name, labels, value, None, None)


def worker(outcomes_ok: float, dead: float, buckets: dict[str, float], lag: float) -> list:
    """One worker's samples of the fraud pipeline."""
    return [
        sample("headrace_outcomes_total", outcomes_ok, pipeline="fraud", status="OK", reason=""),
        sample(
            "headrace_outcomes_total", dead, pipeline="fraud", status="DEAD_LETTER", reason="schema"
        ),
        sample("headrace_answered_in_budget_total", outcomes_ok * 0.9, pipeline="fraud"),
        *(
            sample(
                "headrace_end_to_end_seconds_bucket", count, pipeline="fraud", status="OK", le=le
            )
            for le, count in buckets.items()
        ),
        sample("headrace_latency_budget_seconds", 0.1, pipeline="fraud"),
        sample("headrace_consumer_lag_records", lag, pipeline="fraud", topic="t", partition="0"),
        sample("headrace_oldest_unanswered_seconds", lag / 100, pipeline="fraud"),
        sample("headrace_batch_size_count", outcomes_ok / 10, pipeline="fraud"),
        sample("headrace_batch_size_sum", outcomes_ok, pipeline="fraud"),
        sample("headrace_in_flight_events", 7, pipeline="fraud"),
        sample("headrace_fetch_paused", 0, pipeline="fraud"),
        sample("headrace_model_info", 1, pipeline="fraud", role="full", model="m", version="2"),
        sample("headrace_feature_cache_hits_total", outcomes_ok * 3, view="user_stats"),
        sample("headrace_feature_cache_misses_total", outcomes_ok, view="user_stats"),
    ]


def test_quantiles_interpolate_within_buckets_as_prometheus_does():
    buckets = {"0.01": 50.0, "0.1": 90.0, "1.0": 100.0, "+Inf": 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.01)
    assert quantile(0.7, buckets) == pytest.approx(0.01 + 0.09 * 20 / 40)
    assert quantile(0.99, buckets) == pytest.approx(0.1 + 0.9 * 9 / 10)
    assert quantile(0.99, {"0.1": 0.0, "+Inf": 0.0}) is None
    assert quantile(0.99, {"0.1": 1.0, "+Inf": 10.0}) == 0.1  # beyond the last bound


def test_a_frame_sums_workers_and_takes_a_restarted_ones_counters_from_zero():
    before = Reading(
        10.0,
        {
            "a": worker(1000, 10, {"0.05": 900, "0.1": 1000, "+Inf": 1000}, lag=50),
            "b": worker(5000, 0, {"0.05": 5000, "0.1": 5000, "+Inf": 5000}, lag=0),
        },
    )
    after = Reading(
        12.0,
        {
            "a": worker(1200, 12, {"0.05": 1080, "0.1": 1200, "+Inf": 1200}, lag=150),
            "b": worker(100, 0, {"0.05": 100, "0.1": 100, "+Inf": 100}, lag=0),  # restarted
        },
        failed={"c": "connection refused"},
    )
    frame = compare(before, after)
    (view,) = frame.pipelines
    assert view.rates["OK"] == pytest.approx((200 + 100) / 2)
    assert view.rates["DEAD_LETTER"] == pytest.approx(1.0)
    assert view.in_budget == pytest.approx(0.9)
    assert view.p50_s == pytest.approx(0.05 * 150 / 280)
    assert view.lag == 150 and view.oldest_s == 1.5 and view.in_flight == 14
    assert view.batch_size == pytest.approx(10.0)
    assert view.models == ["m v2"]
    assert frame.cache_hit_rates["user_stats"] == (pytest.approx(0.75), pytest.approx(600.0))
    text = render(frame, ["a", "b", "c"])
    assert re.search(r"^fraud\s+150\.0\s+0\.0\s+0\.0\s+1\.0\s", text, re.MULTILINE), text
    assert "unreachable: c (connection refused)" in text
    assert "user_stats" in text and "75.0%" in text


def test_targets_become_metrics_urls():
    assert metrics_url("127.0.0.1:9108") == "http://127.0.0.1:9108/metrics"
    assert metrics_url("http://w:1/") == "http://w:1/metrics"
    assert metrics_url("http://w:1/metrics") == "http://w:1/metrics"


@pytest.mark.integration
def test_top_once_renders_a_live_workers_pipeline_and_its_rates(deploy, kafka, sample_assets):
    port = free_port()
    deployment = deploy(metrics_port=port, latency_budget_ms=PATIENT_BUDGET_MS)
    spec = deployment.spec
    stop = threading.Event()

    def send() -> None:  # events for as long as top measures
        for seed in range(10_000):
            if stop.wait(0.05):
                return
            produce_events(kafka.bootstrap_servers, spec.input_topic, sample_assets.world, 10,
                           seed=seed, prefix=f"top{seed}")  # fmt: skip

    def answering() -> bool:
        try:
            return total(scrape(port), "headrace_outcomes_total") > 0
        except OSError:
            return False

    sender = threading.Thread(target=send, name="top-load")
    with deployment.worker():
        sender.start()
        try:
            assert wait_until(answering, 90), deployment.log_tail()
            shown = subprocess.run(
                [sys.executable, "-m", "tools.cli", "top", "--once", "--interval", "3",
                 "--target", f"127.0.0.1:{port}"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
        finally:
            stop.set()
            sender.join(30)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    header = [line for line in lines if line.startswith("PIPELINE")]
    row = [line for line in lines if line.startswith(f"{spec.name} ")]
    assert len(header) == len(row) == 1, shown.stdout
    cells = dict(zip(re.split(r"\s{2,}", header[0]), re.split(r"\s{2,}", row[0]), strict=False))
    assert len(cells) == 14, shown.stdout
    assert float(cells["OK/s"]) > 0, shown.stdout
    assert cells["BUDGET ms"] == f"{PATIENT_BUDGET_MS:.1f}", shown.stdout
    # Every answer is in this budget, but a batch's outcomes and its in-budget count are two
    # counters a scrape reads one after the other: the batches a loaded worker finishes in
    # between are missing from one of them (89% seen in CI, from ~600 answers in 3 s).
    assert float(cells["IN BUDGET"].rstrip("%")) > 75, shown.stdout
    assert cells["LAG"] != "-" and float(cells["LAG"]) >= 0, shown.stdout
    assert "fraud-mlp v1" in cells["MODEL"], shown.stdout
    assert "user_stats" in shown.stdout  # the feature cache's hit rate
