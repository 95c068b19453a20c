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


def _step(system: str, rate: float, latency_us: list[int], cpu_us: float) -> StepResult:
    return StepResult(
        system=system, offered_per_s=rate, measured=len(latency_us), answered=len(latency_us),
        unanswered=0, achieved_per_s=rate, latency=LatencySummary.of(np.array(latency_us)),
        statuses={"OK": len(latency_us)}, send_lag_ms=0.0, within_budget=True,
        overloaded=False, cpu_us_per_event={"worker": cpu_us},
    )  # fmt: skip


def test_the_verdicts_compare_headrace_with_mlserver_and_report_its_figures(tmp_path):
    steps = [
        _step("kafka", 100.0, [2_000, 3_000], 0.0),
        _step("headrace", 100.0, [5_000, 6_000], 900.0),
        _step("headrace", 1_200.0, [9_000, 10_000], 300.0),
        _step("bare", 1_000.0, [8_000, 9_000], 250.0),
        _step("mlserver", 100.0, [8_000, 12_000], 2_500.0),
        _step("mlserver", 400.0, [20_000, 30_000], 1_100.0),
    ]
    systems = {
        "headrace": {"sustainable_per_s": 1_200.0},
        "bare": {"sustainable_per_s": 1_000.0},
        "mlserver": {"sustainable_per_s": 400.0, "idle_cores": 0.004, "restarts": 2},
    }
    results = {"settings": BenchSettings().model_dump(mode="json"), "steps": steps,
               "systems": systems, "onnx": [], "elapsed_s": 1.0}  # fmt: skip
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert "MLServer Kafka mode 400/s" in text
    assert "- Faust / MLServer sustainable: 3.00 (target >= 3): met." in text
    assert "- bare / MLServer sustainable: 2.50 (target >= 3): NOT met." in text
    assert "- MLServer: light load (100/s) p50 8.0 ms" in text
    assert "CPU per event at its sustainable rate 1,100.00 µs" in text
    assert "up to 64 events within 2.0 ms" in text
    assert "restarted on new topics 2 times" in text


def test_a_skipped_mlserver_baseline_says_why(tmp_path):
    systems = {"mlserver": {"skipped": "could not install MLServer (exit 1):\npip said no"}}
    results = {"settings": BenchSettings().model_dump(mode="json"), "steps": [],
               "systems": systems, "onnx": [], "elapsed_s": 1.0}  # fmt: skip
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert "MLServer Kafka mode skipped" in text
    assert "- MLServer baseline skipped: could not install MLServer (exit 1):" in text
    assert "Faust / MLServer" not in text
