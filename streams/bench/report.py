"""Verdicts and reports of a benchmark run: Markdown, JSON and a latency plot."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from infra.kafka import KAFKA_VERSION
from streams.bench.harness import StepResult

PACKAGES = ("headrace", "faust-streaming", "aiokafka", "confluent-kafka", "fastavro",
            "onnxruntime-gpu", "feast", "numpy")  # fmt: skip


def sustainable(steps: list[StepResult], system: str) -> float:
    """Highest offered rate the system answered (99% in full) with p99 within budget."""
    passing = [s.offered_per_s for s in steps if s.system == system and s.within_budget]
    return max(passing, default=0.0)


def verdicts(steps: list[StepResult], budget_ms: float) -> dict:
    """The issue's targets: throughput against naive, light-load latency against raw Kafka."""
    headrace = sustainable(steps, "headrace")
    naive = sustainable(steps, "naive")
    bare = sustainable(steps, "bare")
    out: dict = {
        "budget_ms": budget_ms,
        "sustainable_per_s": {"headrace": headrace, "bare": bare, "naive": naive},
        "throughput_ratio_vs_naive": headrace / naive if naive else None,
        "bare_throughput_ratio_vs_naive": bare / naive if naive else None,
    }
    ours = {s.offered_per_s: s for s in steps if s.system == "headrace"}
    kafka = {s.offered_per_s: s for s in steps if s.system == "kafka"}
    common = sorted(set(ours) & set(kafka))
    if headrace and common:
        light = min(common, key=lambda rate: abs(rate - 0.1 * headrace))
        out["light_load"] = {
            "offered_per_s": light,
            "p50_over_kafka_ms": ours[light].latency.p50_ms - kafka[light].latency.p50_ms,
            "p99_over_kafka_ms": ours[light].latency.p99_ms - kafka[light].latency.p99_ms,
        }
    return out


def machine() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kafka": KAFKA_VERSION,
        "packages": versions,
    }


def write_reports(results: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    steps: list[StepResult] = results["steps"]
    budget = results["settings"]["budget_ms"]
    document = {
        "machine": machine(),
        "settings": results["settings"],
        "elapsed_s": results.get("elapsed_s"),
        "verdicts": verdicts(steps, budget),
        "steps": [asdict(s) for s in steps],
        "onnx": results.get("onnx", []),
        "overload": results.get("overload"),
    }
    paths = {
        "json": out_dir / "report.json",
        "markdown": out_dir / "report.md",
        "plot": out_dir / "latency.png",
    }
    paths["json"].write_text(json.dumps(document, indent=2, default=str))
    paths["markdown"].write_text(_markdown(document))
    _plot(steps, budget, paths["plot"])
    return paths


def _markdown(doc: dict) -> str:
    v = doc["verdicts"]
    lines = ["# headrace benchmark", ""]
    m = doc["machine"]
    lines += [
        f"Machine: {m['platform']}, {m['cpus']} CPUs, Python {m['python']}, Kafka {m['kafka']}.",
        "Packages: " + ", ".join(f"{k} {val}" for k, val in m["packages"].items()) + ".",
        f"Run took {doc['elapsed_s'] or 0:.0f} s. Settings: `{json.dumps(doc['settings'])}`.",
        "",
        "Latency is end to end: from each event's intended send time (its Kafka timestamp) "
        "to the moment a consumer reads its answer. Load is open loop.",
        "",
    ]
    if doc["overload"]:
        return "\n".join(lines + _overload_markdown(doc)) + "\n"
    lines += [
        "## Verdicts",
        "",
        f"- Sustainable throughput at p99 <= {v['budget_ms']:.0f} ms: headrace "
        f"{v['sustainable_per_s']['headrace']:.0f}/s, naive per-event loop "
        f"{v['sustainable_per_s']['naive']:.0f}/s"
        + (
            f" (ratio {v['throughput_ratio_vs_naive']:.1f}x; target >= 10x)."
            if v["throughput_ratio_vs_naive"]
            else " (no ratio: naive did not run or met the budget at no rate)."
        ),
        f"- Without Faust (the same stages fed by a bare confluent-kafka consumer): "
        f"{v['sustainable_per_s']['bare']:.0f}/s.",
    ]
    if "light_load" in v:
        light = v["light_load"]
        lines.append(
            f"- Light load ({light['offered_per_s']:.0f}/s): p50 "
            f"{light['p50_over_kafka_ms']:+.1f} ms and p99 {light['p99_over_kafka_ms']:+.1f} ms "
            "over the raw Kafka round trip (targets: within 2 ms and 5 ms)."
        )
    lines += ["", "## Steps", "",
              "| system | offered/s | achieved/s | answered | unanswered | p50 ms | p90 ms "
              "| p99 ms | p99.9 ms | max ms | statuses | within budget |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in doc["steps"]:
        lat = s["latency"]
        lines.append(
            f"| {s['system']} | {s['offered_per_s']:.0f} | {s['achieved_per_s']:.0f} | "
            f"{s['answered']} | {s['unanswered']} | {lat['p50_ms']:.1f} | {lat['p90_ms']:.1f} | "
            f"{lat['p99_ms']:.1f} | {lat['p999_ms']:.1f} | {lat['max_ms']:.1f} | "
            f"{s['statuses']} | {'yes' if s['within_budget'] else 'no'} |"
        )
    profiles = [s for s in doc["steps"] if s["profile"]]
    if profiles:
        lines += ["", "## Worker profiles (mean µs per event, from the workers' stage histograms)",
                  "", "Queueing is the time from the Kafka timestamp to the batch entering the "
                  "pipeline: Kafka, Faust's consumer and the batcher's wait. Worker total runs "
                  "to Kafka's acknowledgement of the outcome.", "",
                  "| runtime | offered/s | mean batch | queueing | decode | features | inference "
                  "| encode | publish | worker total |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for s in profiles:
            p = s["profile"]
            lines.append(
                f"| {s['system']} | {s['offered_per_s']:.0f} | {p['mean_batch_size']:.1f} | "
                f"{p['queueing_us']:.0f} | {p['decode_us']:.0f} | {p['features_us']:.0f} | "
                f"{p['inference_us']:.0f} | {p['encode_us']:.0f} | {p['publish_us']:.0f} | "
                f"{p['worker_total_us']:.0f} |"
            )
    if doc["onnx"]:
        lines += ["", "## Raw ONNX Runtime (same model, one thread)", "",
                  "| batch | p50 µs | p99 µs | µs per event | events/s |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for row in doc["onnx"]:
            lines.append(
                f"| {row['batch_size']} | {row['p50_us']:.0f} | {row['p99_us']:.0f} | "
                f"{row['per_event_us']:.1f} | {row['events_per_s']:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def _overload_markdown(doc: dict) -> list[str]:
    budget = doc["settings"]["budget_ms"]
    lines = ["## Overload", "",
             f"The worker's latency budget is {budget:.0f} ms. Capacity: the highest rate of "
             "answers in full (status OK) over a doubling ramp of offered rates.", ""]  # fmt: skip
    for runtime, capacity in doc["overload"].items():
        lines.append(f"- {runtime} runtime: capacity {capacity:.0f} answers in full per second.")
    lines += ["", "| system | load | offered/s | sent | lost | OK | DEGRADED | SHED "
              "| OK p50 ms | OK p99 ms | DEGRADED p99 ms | SHED p99 ms | OK p99 within budget |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in doc["steps"]:
        if s["multiple"] is None:
            continue
        by = s["by_status"]
        counts = s["statuses"]

        def p(status: str, key: str, by=by) -> str:
            return f"{by[status][key]:.1f}" if status in by else "-"

        within = "OK" in by and by["OK"]["p99_ms"] <= budget
        lines.append(
            f"| {s['system']} | {s['multiple']}x | {s['offered_per_s']:.0f} | {s['measured']} | "
            f"{s['unanswered']} | {counts.get('OK', 0)} | {counts.get('DEGRADED', 0)} | "
            f"{counts.get('SHED', 0)} | {p('OK', 'p50_ms')} | {p('OK', 'p99_ms')} | "
            f"{p('DEGRADED', 'p99_ms')} | {p('SHED', 'p99_ms')} | {'yes' if within else 'no'} |"
        )
    return lines


def _plot(steps: list[StepResult], budget_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    systems = (
        ("headrace", "tab:blue"),
        ("bare", "tab:green"),
        ("naive", "tab:red"),
        ("kafka", "tab:gray"),
    )
    for system, colour in systems:
        ours = [s for s in steps if s.system == system and s.latency.count]
        if not ours:
            continue
        rates = [s.offered_per_s for s in ours]
        axes.plot(rates, [s.latency.p50_ms for s in ours], "-o", color=colour,
                  label=f"{system} p50")  # fmt: skip
        axes.plot(rates, [s.latency.p99_ms for s in ours], "--s", color=colour,
                  label=f"{system} p99")  # fmt: skip
    axes.axhline(budget_ms, color="black", linewidth=0.8, linestyle=":", label="p99 budget")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("offered load (events/s)")
    axes.set_ylabel("end-to-end latency (ms)")
    axes.set_title("headrace and baselines: latency against offered load")
    axes.legend(fontsize=8)
    axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
