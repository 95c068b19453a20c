"""The reports' tables (overload, verdicts, capacity, scale-out) and the capacity plan,
from made-up runs (no services)."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from tools.bench.harness import BenchSettings, StepResult
from tools.bench.latency import LatencySummary
from tools.bench.report import write_reports
from tools.bench.scale import Plan, plan


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


def test_the_report_shows_what_the_host_took_and_which_misses_it_may_explain(tmp_path):
    def step(rate: float, latency_ms: int, stolen: float) -> StepResult:
        made = _step("bare", rate, [latency_ms * 1_000] * 2, 100.0)
        made.within_budget = latency_ms <= 50
        made.machine_cores = {"busy": 1.9, "stolen": stolen}
        return made

    steps = [step(1_000.0, 10, 0.01), step(2_000.0, 80, 0.20), step(3_000.0, 90, 0.0)]
    results = {"settings": BenchSettings().model_dump(mode="json"), "steps": steps,
               "systems": {"bare": {"sustainable_per_s": 1_000.0}}, "onnx": [],
               "elapsed_s": 1.0}  # fmt: skip
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert (
        "- Host steal: up to 0.20 cores in one step (bare at 2,000/s); 1 of the 2 steps over "
        "budget but not overloaded ran while the host took 0.05 cores or more" in text
    )
    row = next(line for line in text.splitlines() if line.startswith("| bare | sweep | 2000"))
    assert row.rstrip().endswith("| 1.90 / 0.20 |")


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


def test_the_verdicts_read_headrace_against_the_plain_relay(tmp_path):
    steps = [
        _step("kafka", 100.0, [2_000, 3_000], 0.0),
        _step("relay", 100.0, [6_000, 7_000], 400.0),
        _step("relay", 1_000.0, [6_000, 7_000], 90.0),
        _step("relay", 4_000.0, [9_000, 10_000], 60.0),
        _step("headrace", 100.0, [5_000, 6_000], 900.0),
        _step("headrace", 1_000.0, [9_000, 10_000], 300.0),
        _step("bare", 100.0, [8_000, 9_000], 700.0),
        _step("bare", 2_000.0, [8_000, 9_000], 250.0),
    ]
    steps[2].phase = "check"
    systems = {
        "headrace": {"sustainable_per_s": 1_000.0},
        "bare": {"sustainable_per_s": 2_000.0},
        "relay": {"sustainable_per_s": 4_000.0, "idle_cores": 0.018},
    }
    results = {"settings": BenchSettings().model_dump(mode="json"), "steps": steps,
               "systems": systems, "onnx": [], "elapsed_s": 1.0}  # fmt: skip
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert "raw Kafka 100/s, naive per-event loop 0/s, plain relay 4,000/s." in text
    assert (
        "- Plain relay (consume and produce, nothing else; fetching as bare does): Faust / "
        "relay sustainable 0.25, bare / relay 0.50; its CPU per event 90.00 µs at 1,000/s, "
        "60.00 µs at its sustainable rate, 400.00 µs at 100/s; idle 0.018 cores."
    ) in text
    # Each runtime's light-load line names the relay's figures at the same rate.
    light = next(line for line in text.splitlines() if line.startswith("- bare: light load"))
    assert light.endswith(
        "The plain relay at that rate: 400.00 µs per event, p50 +4.0 and p99 +4.0 ms over "
        "raw Kafka."
    )


def test_each_pass_runs_the_systems_in_the_opposite_order_to_the_one_before():
    settings = BenchSettings(systems=("kafka", "headrace", "bare"), passes=3)
    assert settings.pass_orders() == [
        ("kafka", "headrace", "bare"),
        ("bare", "headrace", "kafka"),
        ("kafka", "headrace", "bare"),
    ]


def test_a_run_of_two_passes_reads_each_ratio_within_its_pass(tmp_path):
    # Pass 1 was a fast hour for both runtimes, pass 2 a slow one: across passes the
    # ratio would read 800 / 1,000 = 0.8 (met), within each it is 0.6 and 0.8.
    rates = {1: {"kafka": 4_000.0, "headrace": 600.0, "bare": 1_000.0},
             2: {"kafka": 4_000.0, "headrace": 800.0, "bare": 1_000.0}}  # fmt: skip
    steps, passes = [], []
    for number, order in enumerate(BenchSettings(systems=("kafka", "headrace", "bare"),
                                                 passes=2).pass_orders(), 1):  # fmt: skip
        for system in order:
            step = _step(system, rates[number][system], [5_000, 6_000], 100.0)
            step.pass_number = number
            steps.append(step)
        systems = {name: {"sustainable_per_s": rate} for name, rate in rates[number].items()}
        passes.append({"order": list(order), "systems": systems})
    results = {"settings": BenchSettings(passes=2).model_dump(mode="json"), "steps": steps,
               "systems": passes[0]["systems"], "passes": passes, "onnx": [],
               "elapsed_s": 1.0}  # fmt: skip
    paths = write_reports(results, tmp_path)
    text = paths["markdown"].read_text()
    assert "pass 1: kafka, headrace, bare; pass 2: bare, headrace, kafka" in text
    assert "| headrace sustainable | 600/s | 800/s | | |" in text
    assert "| Faust / bare sustainable | 0.60 | 0.80 | >= 0.7 | NOT met |" in text
    assert "- Faust / bare sustainable: 0.60 (target >= 0.7): NOT met." in text
    assert "- Faust / bare sustainable: 0.80 (target >= 0.7): met." in text
    assert text.index("## Verdicts, pass 1") < text.index("## Verdicts, pass 2")
    row = next(line for line in text.splitlines() if line.startswith("| headrace | sweep, pass 2"))
    assert "| 800 |" in row
    report = json.loads(paths["json"].read_text())
    assert [run["verdicts"]["faust_over_bare"] for run in report["passes"]] == [0.6, 0.8]


def test_a_skipped_mlserver_baseline_says_why(tmp_path):
    systems = {"mlserver": {"skipped": "could not install MLServer (exit 1):\npip said no"}}
    results = {"settings": BenchSettings().model_dump(mode="json"), "steps": [],
               "systems": systems, "onnx": [], "elapsed_s": 1.0}  # fmt: skip
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert "MLServer Kafka mode skipped" in text
    assert "- MLServer baseline skipped: could not install MLServer (exit 1):" in text
    assert "Faust / MLServer" not in text


def test_the_capacity_plan_is_the_manifests_arithmetic():
    # infra/k8s: 1,000/s x 0.1 s budget x 0.5 headroom = lagThreshold 50.
    assert plan(1_000.0, 1_000.0, 0.1, 0.5) == Plan(1_000.0, 2, 4, 50)
    assert plan(4_000.0, 4_000.0, 0.1, 0.5) == Plan(4_000.0, 2, 4, 200)
    assert plan(4_000.0, 9_000.0, 0.1, 0.5).workers == 5
    assert plan(4_000.0, 10.0, 0.1, 0.5).workers == 1
    with pytest.raises(ValueError, match="above 0/s"):
        plan(0.0, 100.0, 0.1, 0.5)


def test_the_capacity_report_has_a_plan_row_per_target(tmp_path):
    capacity = {
        "budget_s": 0.1,
        "headroom": 0.5,
        "runtimes": {
            "bare": {
                "sustainable_per_s": 2_000.0,
                "plans": [asdict(plan(2_000.0, 5_000.0, 0.1, 0.5))],
            }
        },
    }
    results = {"settings": BenchSettings(scenario="capacity").model_dump(mode="json"),
               "steps": [_step("capacity-bare", 2_000.0, [5_000, 9_000], 400.0)],
               "systems": {}, "capacity": capacity, "elapsed_s": 1.0}  # fmt: skip
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert "### bare runtime: one worker sustains 2,000 events/s" in text
    assert "| 5,000 | 5 | 10 | 100 |" in text  # 5,000 / (2,000 x 0.5); 2,000 x 0.1 x 0.5
    assert "| capacity-bare | sweep | 2000 |" in text


def test_the_scaleout_report_says_when_the_machine_bounds_the_sum(tmp_path):
    def row(workers: int, rate: float, cores: dict[str, float]) -> dict:
        return {"workers": workers, "sustainable_per_s": rate, "cores": cores,
                "partitions_per_worker": [12 // workers] * workers}  # fmt: skip

    # A single worker's cores come with their split by thread, which is not a process.
    split = {"worker/loop": 0.6, "worker/librdkafka": 0.1, "worker/other": 0.2}
    rows = [row(1, 2_000.0, {"worker": 0.9, **split, "broker": 0.3, "load generator": 0.3}),
            row(3, 2_200.0, {"worker 1": 0.4, "worker 2": 0.4, "worker 3": 0.4,
                             "broker": 0.3, "load generator": 0.3})]  # fmt: skip
    scaleout = {"machine_cores": 2, "partitions": 12, "runtimes": {"bare": rows}}
    results = {"settings": BenchSettings(scenario="scaleout").model_dump(mode="json"),
               "steps": [], "systems": {}, "scaleout": scaleout, "elapsed_s": 1.0}  # fmt: skip
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert "| 1 (bare) | [12] | 2,000 | 2,000 | 0.90 | 0.30 | 0.30 | 1.50 |" in text
    assert "| 3 (bare) | [4, 4, 4] | 2,200 | 733 | 0.40, 0.40, 0.40 | 0.30 | 0.30 | 1.80 |" in text
    assert "3 workers sustain 1.10x one worker's rate" in text
    assert "The machine, not headrace, bounds the sum here" in text


def test_a_ratio_to_a_raw_kafka_that_passed_every_rate_is_only_an_upper_bound(tmp_path):
    # Raw Kafka passed the top rate, 25,600/s: its limit is higher, so 0.62 may be less.
    steps = [
        _step("kafka", 25_600.0, [2_000, 3_000], 0.0),
        _step("headrace", 16_000.0, [9_000, 10_000], 40.0),
        _step("bare", 8_000.0, [8_000, 9_000], 50.0),
    ]
    systems = {
        "kafka": {"sustainable_per_s": 25_600.0, "first_failing_per_s": None, "capped": True},
        "headrace": {"sustainable_per_s": 16_000.0},
        "bare": {"sustainable_per_s": 8_000.0},
    }
    results = {"settings": BenchSettings().model_dump(mode="json"), "steps": steps,
               "systems": systems, "onnx": [], "elapsed_s": 1.0}  # fmt: skip
    text = write_reports(results, tmp_path)["markdown"].read_text()
    assert (
        "- Faust / raw Kafka sustainable: at most 0.62 (target >= 0.5): cannot tell: raw "
        "Kafka passed every rate offered (raise --sweep-max to find its limit)." in text
    )
    assert "- bare / raw Kafka sustainable: at most 0.31 (target >= 0.5): NOT met." in text
    # With its limit found, the ratio is a figure again.
    systems["kafka"] = {"sustainable_per_s": 51_200.0, "first_failing_per_s": 102_400.0,
                        "capped": False}  # fmt: skip
    text = write_reports(results, tmp_path / "found")["markdown"].read_text()
    assert "- Faust / raw Kafka sustainable: 0.31 (target >= 0.5): NOT met." in text
