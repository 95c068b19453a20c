"""The overload report's table, from a made-up run (no services)."""

from __future__ import annotations

import numpy as np

from tools.bench.harness import BenchSettings, StepResult
from tools.bench.latency import LatencySummary
from tools.bench.report import write_reports


def test_the_overload_report_has_a_row_per_load_with_counts_per_status(tmp_path):
    ok = LatencySummary.of(np.array([10_000, 20_000]))  # µs
    shed = LatencySummary.of(np.array([300_000]))
    step = StepResult(
        system="overload-bare", offered_per_s=400.0, measured=3, answered=3, unanswered=0,
        achieved_per_s=0.6, latency=LatencySummary.of(np.array([10_000, 20_000, 300_000])),
        statuses={"OK": 2, "SHED": 1}, send_lag_ms=0.0, within_budget=False, overloaded=False,
        by_status={"OK": ok, "SHED": shed}, multiple=2.0,
    )  # fmt: skip
    results = {
        "settings": BenchSettings(scenario="overload", budget_ms=250).model_dump(mode="json"),
        "steps": [step],
        "overload": {"bare": 200.0},
        "onnx": [],
        "elapsed_s": 1.0,
    }
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert "bare runtime: capacity 200 answers in full per second" in text
    row = next(line for line in text.splitlines() if line.startswith("| overload-bare"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    # system, load, offered, sent, lost, OK, DEGRADED, SHED, then p50/p99 per status, verdict
    assert cells[:8] == ["overload-bare", "2.0x", "400", "3", "0", "2", "0", "1"]
    assert cells[10] == "-"  # nothing degraded
    assert float(cells[11]) >= 299
    assert cells[12] == "yes"  # the OK answers' p99 (20 ms) is within 250 ms
