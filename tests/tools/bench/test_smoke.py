"""A tiny benchmark sweep: the reports exist and agree with themselves (no timing asserts)."""

from __future__ import annotations

import json
import os

import pytest

from streams.config import load_config
from tools.bench.harness import Bench, BenchSettings
from tools.bench.report import write_reports

pytestmark = pytest.mark.integration

CORES = os.cpu_count() or 1


def test_tiny_sweep_produces_a_self_consistent_report(kafka, sample_assets, tmp_path):
    settings = BenchSettings(
        rates=(40.0, 80.0),
        warmup_s=0.5,
        measure_s=1.0,
        drain_timeout_s=60.0,
        refine_steps=1,
        repeats=1,
        idle_s=0.5,
        # Not MLServer: it needs its own environment, built from PyPI (never by the tests).
        systems=("kafka", "relay", "headrace", "bare", "naive"),
        # The latency-first fetch settings, which reach every worker's config.
        fetch_min_bytes=1,
        fetch_max_wait_ms=500,
        bootstrap_servers=kafka.bootstrap_servers,
        # The session's assets folder: the trained model is reused.
        state_dir=sample_assets.repo.parent,
    )
    results = Bench(settings, echo=lambda *args, **kwargs: None).run()
    paths = write_reports(results, tmp_path / "report")

    assert paths["plot"].stat().st_size > 0
    for runtime in ("headrace", "bare"):
        broker = load_config(settings.state_dir / f"{runtime}.yaml").broker
        assert (broker.fetch_min_bytes, broker.fetch_max_wait_ms) == (1, 500)
    assert "## Verdicts" in paths["markdown"].read_text()
    report = json.loads(paths["json"].read_text())
    systems = {step["system"] for step in report["steps"]}
    assert systems == {"headrace", "bare", "kafka", "relay", "naive"}
    for step in report["steps"]:
        assert step["measured"] > 0
        # At these rates every system answers every event it was sent (SHED included):
        # `unanswered` is what the reader never saw, so a lost answer fails here.
        assert step["answered"] == step["measured"] and step["unanswered"] == 0, step
        assert sum(step["statuses"].values()) == step["answered"]
        latency = step["latency"]
        assert latency["count"] == step["answered"]
        ordered = [latency[k] for k in ("p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")]
        assert ordered == sorted(ordered)
        # The machine was busy (a broker, a load generator), never more than all its cores.
        machine = step["machine_cores"]
        assert machine["busy"] > 0 and machine["busy"] + machine["stolen"] <= CORES * 1.05
    headrace_steps = [s for s in report["steps"] if s["system"] in ("headrace", "bare")]
    assert all(s["profile"]["events"] > 0 for s in headrace_steps)
    assert report["onnx"][0]["batch_size"] == 1
    cold = report["onnx_after_idle"]
    assert cold["hot_cpu_p50_us"] > 0 and cold["after_gap_cpu_p50_us"] > 0
    assert "µs after 10 ms idle each time" in paths["markdown"].read_text()
    verdicts = report["verdicts"]
    assert set(verdicts["sustainable_per_s"]) == {"headrace", "bare", "naive", "kafka", "relay"}
    # The relay copies the inputs: every one comes back, and it has the worker's figures.
    relay_steps = [s for s in report["steps"] if s["system"] == "relay"]
    assert all(set(s["statuses"]) == {"RAW"} and s["unanswered"] == 0 for s in relay_steps)
    assert all(s["cpu_us_per_event"]["worker"] > 0 for s in relay_steps)
    assert verdicts["relay"]["idle_cores"] is not None
    assert report["machine"]["packages"]["headrace"]
