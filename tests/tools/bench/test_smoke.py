"""A tiny benchmark sweep: the reports exist and agree with themselves (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from tools.bench.harness import Bench, BenchSettings
from tools.bench.report import write_reports

pytestmark = pytest.mark.integration


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
        systems=("kafka", "headrace", "bare", "naive"),
        bootstrap_servers=kafka.bootstrap_servers,
        # The session's assets folder: the trained model is reused.
        state_dir=sample_assets.repo.parent,
    )
    results = Bench(settings, echo=lambda *args, **kwargs: None).run()
    paths = write_reports(results, tmp_path / "report")

    assert paths["plot"].stat().st_size > 0
    assert "## Verdicts" in paths["markdown"].read_text()
    report = json.loads(paths["json"].read_text())
    systems = {step["system"] for step in report["steps"]}
    assert systems == {"headrace", "bare", "kafka", "naive"}
    for step in report["steps"]:
        assert step["measured"] > 0
        assert step["answered"] + step["unanswered"] == step["measured"]
        assert sum(step["statuses"].values()) == step["answered"]
        latency = step["latency"]
        assert latency["count"] == step["answered"]
        ordered = [latency[k] for k in ("p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")]
        assert ordered == sorted(ordered)
    headrace_steps = [s for s in report["steps"] if s["system"] in ("headrace", "bare")]
    assert all(s["profile"]["events"] > 0 for s in headrace_steps)
    assert report["onnx"][0]["batch_size"] == 1
    verdicts = report["verdicts"]
    assert set(verdicts["sustainable_per_s"]) == {"headrace", "bare", "naive", "kafka"}
    assert report["machine"]["packages"]["headrace"]
