"""The swap scenario's verdict and report section, from made-up runs (no services)."""

from __future__ import annotations

import pytest

from tools.bench.harness import BenchSettings
from tools.bench.report import write_reports
from tools.bench.swap import verdict


def pair(without_ms: float, with_ms: float, version: str = "2") -> dict:
    return {"version": version, "without_p99_ms": without_ms, "with_p99_ms": with_ms,
            "served_after_s": 1.0}  # fmt: skip


def test_a_swap_is_within_bounds_when_its_median_p99_is_within_a_tenth():
    within = verdict([pair(20.0, 21.0), pair(30.0, 22.5), pair(18.0, 19.0)])
    assert within["without_p99_ms"] == 20.0 and within["with_p99_ms"] == 21.0
    assert within["ratio"] == pytest.approx(1.05) and within["met"]
    # One noisy pair does not decide it, a slower median does.
    assert not verdict([pair(20.0, 23.0), pair(20.0, 23.0), pair(20.0, 15.0)])["met"]
    assert verdict([])["met"] is None


def test_the_report_shows_each_pair_the_verdict_and_the_shadow_rates(tmp_path):
    pairs = [pair(20.0, 30.0), pair(20.0, 30.0, version="1")]
    results = {
        "settings": BenchSettings(scenario="swap").model_dump(mode="json"),
        "steps": [],
        "swap": {"tolerance": 0.1, "window_s": 5.0, "runtimes": {"bare": {
            "rate_per_s": 400.0, "pairs": pairs, **verdict(pairs),
            "sustainable_per_s": 1_600.0, "with_shadow_per_s": 800.0,
        }}},
        "elapsed_s": 1.0,
    }  # fmt: skip
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert "| 2 | v1 | 20.0 | 30.0 | 1.0 |" in text
    assert "p99 30.0 ms with, 20.0 ms without (1.50x; target <= 1.10x): NOT met" in text
    assert "1,600/s without a candidate, 800/s with a shadow candidate (0.50x)" in text
