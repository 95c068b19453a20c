"""Verdicts and reports of a benchmark run: Markdown, JSON and a latency plot."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from infra.kafka import KAFKA_VERSION
from tools.bench import flame, scale, swap
from tools.bench.harness import OVERLOAD_MULTIPLES, StepResult

PACKAGES = ("headrace", "faust-streaming", "aiokafka", "confluent-kafka", "fastavro",
            "onnxruntime-gpu", "feast", "numpy")  # fmt: skip


# Cores taken by the host during a step above which its budget miss may be the machine's:
# a twentieth of a core is a stall of tens of milliseconds every second on a busy core.
NOTABLE_STEAL_CORES = 0.05


def sustainable(steps: list[StepResult], system: str) -> float:
    """Highest offered rate the system answered (99% in full) with p99 within budget."""
    passing = [s.offered_per_s for s in steps if s.system == system and s.within_budget]
    return max(passing, default=0.0)


# The targets (performance issue): bounds on ratios and CPU figures.
FAUST_OVER_BARE_MIN = 0.7
OVER_KAFKA_MIN = 0.5
CPU_AT_SUSTAINABLE_MAX_US = 100.0
CPU_AT_LIGHT_LOAD_MAX_US = 500.0
LIGHT_P50_OVER_KAFKA_MAX_MS = 2.0
LIGHT_P99_OVER_KAFKA_MAX_MS = 5.0
FAUST_CPU_OVER_BARE_MAX = 1.3
IDLE_MAX_CORES = 0.02
OVER_MLSERVER_MIN = 3.0
RUNTIMES = (("headrace", "faust"), ("bare", "bare"))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def verdicts(steps: list[StepResult], budget_ms: float, systems: dict | None = None) -> dict:
    """Every target of the performance issue with its figure: sustainable rates and their
    ratios, CPU per event (at the sustainable rate, at light load, at 1,000/s, idle) and
    light-load latency over the raw Kafka round trip."""
    systems = systems or {}
    # The sweep's own figure (every repeat of a refining rate passed) where it ran.
    names = ["headrace", "bare", "naive", "kafka"]
    for optional in ("relay", "mlserver"):
        if optional in systems or any(s.system == optional for s in steps):
            names.append(optional)
    rates = {
        name: systems.get(name, {}).get("sustainable_per_s", sustainable(steps, name))
        for name in names
    }
    out: dict = {
        "budget_ms": budget_ms,
        "sustainable_per_s": rates,
        "throughput_ratio_vs_naive": _ratio(rates["headrace"], rates["naive"]),
        "bare_throughput_ratio_vs_naive": _ratio(rates["bare"], rates["naive"]),
        "faust_over_bare": _ratio(rates["headrace"], rates["bare"]),
        "faust_over_kafka": _ratio(rates["headrace"], rates["kafka"]),
        "bare_over_kafka": _ratio(rates["bare"], rates["kafka"]),
        # Raw Kafka passed every rate offered: its limit is higher, so the two ratios
        # above are only upper bounds.
        "kafka_capped": bool(systems.get("kafka", {}).get("capped")),
        "runtimes": {},
    }
    for system, runtime in RUNTIMES:
        figures = _worker_figures(steps, system, rates[system], systems)
        if figures is not None:
            out["runtimes"][runtime] = figures
    if "relay" in rates:
        out["faust_over_relay"] = _ratio(rates["headrace"], rates["relay"])
        out["bare_over_relay"] = _ratio(rates["bare"], rates["relay"])
        out["relay"] = _worker_figures(steps, "relay", rates["relay"], systems) or {}
    if "mlserver" in rates:
        out["faust_over_mlserver"] = _ratio(rates["headrace"], rates["mlserver"])
        out["bare_over_mlserver"] = _ratio(rates["bare"], rates["mlserver"])
        out["mlserver"] = _worker_figures(steps, "mlserver", rates["mlserver"], systems) or {}
        out["mlserver"]["restarts"] = systems.get("mlserver", {}).get("restarts", 0)
        if "skipped" in systems.get("mlserver", {}):
            out["mlserver"]["skipped"] = systems["mlserver"]["skipped"]
    faust, bare = out["runtimes"].get("faust", {}), out["runtimes"].get("bare", {})
    out["faust_cpu_over_bare_at_1000"] = _ratio(
        faust.get("cpu_us_at_1000"), bare.get("cpu_us_at_1000")
    )
    return out


def _worker_figures(
    steps: list[StepResult], system: str, rate: float, systems: dict
) -> dict | None:
    """A worker process's CPU figures (idle, at its sustainable rate, at 1,000/s) and its
    light-load step (the sweep rate nearest 10% of its sustainable one) beside raw
    Kafka's at that rate (and the relay's, where it ran that rate); None if it has no
    steps."""
    ours = [s for s in steps if s.system == system]
    if not ours:
        return None
    kafka = {s.offered_per_s: s for s in steps if s.system == "kafka" and s.phase == "sweep"}
    figures: dict = {"idle_cores": systems.get(system, {}).get("idle_cores")}
    at_limit = [s for s in ours if s.within_budget and s.offered_per_s == rate]
    if at_limit:
        figures["cpu_us_at_sustainable"] = at_limit[-1].cpu_us_per_event.get("worker")
    checks = [s for s in ours if s.phase == "check"]
    if checks:
        figures["cpu_us_at_1000"] = checks[-1].cpu_us_per_event.get("worker")
    sweep = {s.offered_per_s: s for s in ours if s.phase == "sweep"}
    common = sorted(set(sweep) & set(kafka))
    if rate and common:
        light = min(common, key=lambda r: abs(r - 0.1 * rate))
        figures["light_load"] = {
            "offered_per_s": light,
            "cpu_us": sweep[light].cpu_us_per_event.get("worker"),
            "p50_ms": sweep[light].latency.p50_ms,
            "p99_ms": sweep[light].latency.p99_ms,
            "p50_over_kafka_ms": sweep[light].latency.p50_ms - kafka[light].latency.p50_ms,
            "p99_over_kafka_ms": sweep[light].latency.p99_ms - kafka[light].latency.p99_ms,
        }
        relay = [s for s in steps if s.system == "relay" and s.phase == "sweep"
                 and s.offered_per_s == light]  # fmt: skip
        if relay and system != "relay":
            figures["light_load"]["relay"] = {
                "cpu_us": relay[-1].cpu_us_per_event.get("worker"),
                "p50_over_kafka_ms": relay[-1].latency.p50_ms - kafka[light].latency.p50_ms,
                "p99_over_kafka_ms": relay[-1].latency.p99_ms - kafka[light].latency.p99_ms,
            }
    return figures


def _target_lines(v: dict, systems: dict) -> list[str]:
    """One line per target: the figure, the bound, met or not."""

    def met(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "NOT met")

    def rate(name: str) -> str:
        if "skipped" in systems.get(name, {}):
            return "skipped"
        figure = f"{v['sustainable_per_s'][name]:,.0f}/s"
        info = systems.get(name, {})
        if info.get("capped"):
            return f">= {figure} (passed every rate offered)"
        if info.get("first_failing_per_s"):
            return f"{figure} (failed at {info['first_failing_per_s']:,.0f}/s)"
        return figure

    def fmt(x: float | None, unit: str = "") -> str:
        # Cores are fractions near 0.02 (the idle target): a third digit tells them apart.
        return "-" if x is None else f"{x:,.{3 if unit == ' cores' else 2}f}{unit}"

    lines = [
        f"- Sustainable rates: faust runtime {rate('headrace')}, bare {rate('bare')}, "
        f"raw Kafka {rate('kafka')}, naive per-event loop {rate('naive')}"
        + (f", plain relay {rate('relay')}" if "relay" in v["sustainable_per_s"] else "")
        + (
            f", MLServer Kafka mode {rate('mlserver')}."
            if "mlserver" in v["sustainable_per_s"]
            else "."
        )
    ]
    ratio = v["faust_over_bare"]
    lines.append(
        f"- Faust / bare sustainable: {fmt(ratio)} (target >= {FAUST_OVER_BARE_MIN}): "
        f"{met(None if ratio is None else ratio >= FAUST_OVER_BARE_MIN)}."
    )
    for key, label in (("faust_over_kafka", "Faust"), ("bare_over_kafka", "bare")):
        ratio = v[key]
        if ratio is not None and v.get("kafka_capped"):
            lines.append(
                f"- {label} / raw Kafka sustainable: at most {fmt(ratio)} (target >= "
                f"{OVER_KAFKA_MIN}): "
                + ("NOT met." if ratio < OVER_KAFKA_MIN else "cannot tell: raw Kafka passed "
                   "every rate offered (raise --sweep-max to find its limit).")
            )  # fmt: skip
            continue
        lines.append(
            f"- {label} / raw Kafka sustainable: {fmt(ratio)} (target >= "
            f"{OVER_KAFKA_MIN}): "
            f"{met(None if ratio is None else ratio >= OVER_KAFKA_MIN)}."
        )
    for runtime, figures in v["runtimes"].items():
        cpu = figures.get("cpu_us_at_sustainable")
        bound = CPU_AT_SUSTAINABLE_MAX_US if runtime == "bare" else None
        lines.append(
            f"- {runtime}: worker CPU per event at its sustainable rate "
            f"{fmt(cpu, ' µs')}"
            + (
                f" (target < {bound:.0f} µs): {met(None if cpu is None else cpu < bound)}."
                if bound
                else "."
            )
        )
        light = figures.get("light_load")
        if light:
            cpu = light["cpu_us"]
            lines.append(
                f"- {runtime}: light load ({light['offered_per_s']:,.0f}/s) worker CPU per event "
                f"{fmt(cpu, ' µs')} (target < {CPU_AT_LIGHT_LOAD_MAX_US:.0f} µs): "
                f"{met(None if cpu is None else cpu < CPU_AT_LIGHT_LOAD_MAX_US)}; p50 "
                f"{light['p50_over_kafka_ms']:+.1f} ms and p99 {light['p99_over_kafka_ms']:+.1f} "
                f"ms over the raw Kafka round trip (targets: within "
                f"{LIGHT_P50_OVER_KAFKA_MAX_MS:.0f} and {LIGHT_P99_OVER_KAFKA_MAX_MS:.0f} ms): "
                f"{met(light['p50_over_kafka_ms'] <= LIGHT_P50_OVER_KAFKA_MAX_MS)}, "
                f"{met(light['p99_over_kafka_ms'] <= LIGHT_P99_OVER_KAFKA_MAX_MS)}."
                + _relay_at_light_load(light.get("relay"), fmt)
            )
        lines.append(
            f"- {runtime}: worker CPU per event at 1,000/s "
            f"{fmt(figures.get('cpu_us_at_1000'), ' µs')}."
        )
        idle = figures.get("idle_cores")
        lines.append(
            f"- {runtime}: idle worker {fmt(idle, ' cores')} (target < "
            f"{IDLE_MAX_CORES} cores): "
            f"{met(None if idle is None else idle < IDLE_MAX_CORES)}."
        )
    ratio = v["faust_cpu_over_bare_at_1000"]
    lines.append(
        f"- Faust / bare worker CPU per event at 1,000/s: {fmt(ratio)} (target <= "
        f"{FAUST_CPU_OVER_BARE_MAX}): "
        f"{met(None if ratio is None else ratio <= FAUST_CPU_OVER_BARE_MAX)}."
    )
    if "relay" in v:
        lines += _relay_lines(v, fmt)
    if "mlserver" in v:
        lines += _mlserver_lines(v, fmt, met)
    return lines


def _relay_at_light_load(relay: dict | None, fmt) -> str:
    if not relay:
        return ""
    return (
        f" The plain relay at that rate: {fmt(relay['cpu_us'], ' µs')} per event, p50 "
        f"{relay['p50_over_kafka_ms']:+.1f} and p99 {relay['p99_over_kafka_ms']:+.1f} ms over "
        "raw Kafka."
    )


def _relay_lines(v: dict, fmt) -> list[str]:
    """The plain relay: what Kafka alone costs a Python worker here, and headrace's
    rates against its rate (no target: a floor to read the targets against)."""
    figures = v["relay"]
    cpu = [
        f"{fmt(figures.get('cpu_us_at_1000'), ' µs')} at 1,000/s",
        f"{fmt(figures.get('cpu_us_at_sustainable'), ' µs')} at its sustainable rate",
    ]
    light = figures.get("light_load")
    if light:
        cpu.append(f"{fmt(light['cpu_us'], ' µs')} at {light['offered_per_s']:,.0f}/s")
    return [
        f"- Plain relay (consume and produce, nothing else; fetching as bare does): Faust / "
        f"relay sustainable {fmt(v['faust_over_relay'])}, bare / relay "
        f"{fmt(v['bare_over_relay'])}; its CPU per event {', '.join(cpu)}; idle "
        f"{fmt(figures.get('idle_cores'), ' cores')}."
    ]


def _mlserver_lines(v: dict, fmt, met) -> list[str]:
    """The MLServer baseline: headrace's ratios to it (target 3x) and its own figures."""
    figures = v["mlserver"]
    if "skipped" in figures:
        first = figures["skipped"].strip().splitlines()[0]
        return [f"- MLServer baseline skipped: {first}"]
    lines = []
    for key, label in (("faust_over_mlserver", "Faust"), ("bare_over_mlserver", "bare")):
        ratio = v[key]
        lines.append(
            f"- {label} / MLServer sustainable: {fmt(ratio)} (target >= {OVER_MLSERVER_MIN:g}): "
            f"{met(None if ratio is None else ratio >= OVER_MLSERVER_MIN)}."
        )
    light = figures.get("light_load")
    if light:
        lines.append(
            f"- MLServer: light load ({light['offered_per_s']:,.0f}/s) p50 {light['p50_ms']:.1f} "
            f"ms, p99 {light['p99_ms']:.1f} ms ({light['p50_over_kafka_ms']:+.1f} and "
            f"{light['p99_over_kafka_ms']:+.1f} ms over the raw Kafka round trip), "
            f"CPU per event {fmt(light['cpu_us'], ' µs')}."
        )
    lines.append(
        f"- MLServer: CPU per event at its sustainable rate "
        f"{fmt(figures.get('cpu_us_at_sustainable'), ' µs')}, at 1,000/s "
        f"{fmt(figures.get('cpu_us_at_1000'), ' µs')}; idle "
        f"{fmt(figures.get('idle_cores'), ' cores')}."
    )
    if figures.get("restarts"):
        lines.append(
            f"- MLServer did not work off an overload's backlog (it reads without "
            f"backpressure) and was restarted on new topics {figures['restarts']} times, "
            "so that each later step started from an idle server."
        )
    return lines


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
    systems = results.get("systems", {})
    flames = _write_flames(systems, out_dir)
    passes = []
    for number, run in enumerate(results.get("passes", []), 1):
        ours = [s for s in steps if s.pass_number == number]
        passes.append({**run, "verdicts": verdicts(ours, budget, run["systems"])})
    document = {
        "machine": machine(),
        "settings": results["settings"],
        "elapsed_s": results.get("elapsed_s"),
        # With several passes: the first pass's (each pass's are in `passes`).
        "verdicts": passes[0]["verdicts"] if passes else verdicts(steps, budget, systems),
        "passes": passes if len(passes) > 1 else None,
        "systems": systems,
        "steps": [asdict(s) for s in steps],
        "onnx": results.get("onnx", []),
        "onnx_after_idle": results.get("onnx_after_idle"),
        "overload": results.get("overload"),
        "capacity": results.get("capacity"),
        "scaleout": results.get("scaleout"),
        "swap": results.get("swap"),
    }
    paths = {
        "json": out_dir / "report.json",
        "markdown": out_dir / "report.md",
        "plot": out_dir / "latency.png",
    }
    paths["json"].write_text(json.dumps(document, indent=2, default=str))
    paths["markdown"].write_text(_markdown(document))
    if document["overload"]:
        _plot_overload(steps, budget, paths["plot"])
    else:
        _plot(steps, budget, paths["plot"])
    return {**paths, **flames}


def _write_flames(systems: dict, out_dir: Path) -> dict[str, Path]:
    """A flame graph per sampled worker, beside the reports."""
    paths = {}
    for name, info in systems.items():
        sampled = info.get("flame")
        if sampled and Path(sampled["stacks"]).exists():
            stacks = flame.read_stacks(Path(sampled["stacks"]))
            title = f"{name} worker at {sampled['rate_per_s']:,.0f} events/s"
            paths[f"flame-{name}"] = flame.write_svg(stacks, title, out_dir / f"flame-{name}.svg")
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
    if doc["capacity"] or doc["scaleout"]:
        return "\n".join(lines + scale.markdown(doc) + _steps_markdown(doc)) + "\n"
    if doc["swap"]:
        return "\n".join(lines + swap.markdown(doc["swap"]) + _steps_markdown(doc)) + "\n"
    if doc.get("passes"):
        lines += _passes_markdown(doc["passes"], _steal_line(doc["steps"]))
    else:
        lines += ["## Verdicts", "", *_target_lines(v, doc["systems"]), *_steal_line(doc["steps"])]
    if v["throughput_ratio_vs_naive"]:
        lines.append(
            f"- headrace (Faust) over the naive per-event loop: "
            f"{v['throughput_ratio_vs_naive']:.1f}x."
        )
    if "mlserver" in v and "skipped" not in v["mlserver"]:
        lines += ["", _mlserver_note(doc["settings"])]
    lines += _systems_markdown(doc["systems"])
    lines += _steps_markdown(doc)
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
    idle = doc.get("onnx_after_idle")
    if idle:
        lines += ["", f"Batch size 1, CPU time per run (median of {idle['runs']}): "
                  f"{idle['hot_cpu_p50_us']:.0f} µs back to back, "
                  f"{idle['after_gap_cpu_p50_us']:.0f} µs after {idle['gap_ms']:.0f} ms idle "
                  "each time. A worker at light load runs every small batch after such a "
                  "gap, with the machine's caches gone cold: part of its CPU per event "
                  "is this machine's, not its code's."]  # fmt: skip
    return "\n".join(lines) + "\n"


# The side-by-side table of a run of several passes: its rates and the ratio targets.
PASS_RATIOS = (
    ("faust_over_bare", "Faust / bare sustainable", FAUST_OVER_BARE_MIN),
    ("faust_over_kafka", "Faust / raw Kafka sustainable", OVER_KAFKA_MIN),
    ("bare_over_kafka", "bare / raw Kafka sustainable", OVER_KAFKA_MIN),
    ("faust_over_mlserver", "Faust / MLServer sustainable", OVER_MLSERVER_MIN),
    ("bare_over_mlserver", "bare / MLServer sustainable", OVER_MLSERVER_MIN),
)


def _passes_markdown(passes: list[dict], run_lines: list[str]) -> list[str]:
    """A run of several passes: the rates and ratio targets of every pass side by side
    (a target is met only where every pass meets it), `run_lines` about the whole run,
    then each pass's verdicts."""
    orders = "; ".join(f"pass {n}: {', '.join(run['order'])}"
                       for n, run in enumerate(passes, 1))  # fmt: skip
    lines = [
        "## Passes side by side",
        "",
        "Every system is swept once per pass, each pass in the opposite order to the one "
        f"before ({orders}).",
        "",
        "| figure | " + " | ".join(f"pass {n}" for n in range(1, len(passes) + 1))
        + " | target | every pass |",
        "|---|" + "---|" * len(passes) + "---|---|",
    ]  # fmt: skip
    for name in passes[0]["order"]:
        cells = [f"{run['verdicts']['sustainable_per_s'].get(name, 0):,.0f}/s" for run in passes]
        lines.append(f"| {name} sustainable | " + " | ".join(cells) + " | | |")
    for key, label, bound in PASS_RATIOS:
        figures = [run["verdicts"].get(key) for run in passes]
        if all(figure is None for figure in figures):
            continue
        # Against a raw Kafka that passed every rate, a ratio is only an upper bound.
        capped = ["kafka" in key and run["verdicts"].get("kafka_capped") for run in passes]
        cells = ["-" if figure is None else f"{'<= ' if upper else ''}{figure:.2f}"
                 for figure, upper in zip(figures, capped, strict=True)]  # fmt: skip
        every = all(figure is not None and figure >= bound for figure in figures)
        verdict = "met" if every else "NOT met"
        if every and any(capped):
            verdict = "cannot tell"
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | >= {bound} | {verdict} |")  # fmt: skip
    if run_lines:
        lines += ["", *run_lines]
    for n, run in enumerate(passes, 1):
        lines += ["", f"## Verdicts, pass {n}", ""]
        lines += _target_lines(run["verdicts"], run["systems"])
    return lines


def _steps_markdown(doc: dict) -> list[str]:
    """Every step of the run, one row each."""
    lines = [
        "",
        "## Steps",
        "",
        "CPU columns: µs of CPU per event sent in the step (warm-up, window and drain), "
        "per process; the load generator includes the reading consumers. The worker's "
        "is split by thread (one worker only): its event loop (main thread), "
        "librdkafka's threads, and its other threads. Machine: mean cores the whole "
        "machine kept busy over the step, and cores its host took (steal).",
        "",
        "| system | phase | offered/s | achieved/s | answered | unanswered | p50 ms "
        "| p90 ms | p99 ms | p99.9 ms | max ms | statuses | within budget "
        "| worker µs/ev | loop / librdkafka / threads | broker µs/ev | loadgen µs/ev "
        "| machine busy / stolen cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in doc["steps"]:
        lat = s["latency"]
        cpu = s.get("cpu_us_per_event", {})

        def us(name: str, cpu=cpu) -> str:
            # Several workers of one group ("worker 1", "worker 2"): their sum.
            spent = [v for key, v in cpu.items() if key == name or key.startswith(f"{name} ")]
            return f"{sum(spent):.0f}" if spent else "-"

        threads = " / ".join(us(f"worker/{part}") for part in ("loop", "librdkafka", "threads"))
        lines.append(
            f"| {s['system']} | {_phase_cell(s)} | {s['offered_per_s']:.0f} | "
            f"{s['achieved_per_s']:.0f} | {s['answered']} | {s['unanswered']} | "
            f"{lat['p50_ms']:.1f} | {lat['p90_ms']:.1f} | {lat['p99_ms']:.1f} | "
            f"{lat['p999_ms']:.1f} | {lat['max_ms']:.1f} | {s['statuses']} | "
            f"{'yes' if s['within_budget'] else 'no'} | {us('worker')} | {threads} | "
            f"{us('broker')} | {us('load generator')} | {_machine_cell(s)} |"
        )
    return lines


def _phase_cell(step: dict) -> str:
    phase = step.get("phase", "sweep")
    number = step.get("pass_number", 1)
    return phase if number == 1 else f"{phase}, pass {number}"


def _machine_cell(step: dict) -> str:
    cores = step.get("machine_cores") or {}
    if not cores:
        return "-"
    return f"{cores['busy']:.2f} / {cores['stolen']:.2f}"


def _steal_line(steps: list[dict]) -> list[str]:
    """How much the host took from the machine, and which budget misses it may explain."""
    measured = [s for s in steps if s.get("machine_cores")]
    if not measured:
        return []
    most = max(measured, key=lambda s: s["machine_cores"]["stolen"])
    missed = [s for s in measured if not s["within_budget"] and not s["overloaded"]]
    noisy = [s for s in missed if s["machine_cores"]["stolen"] >= NOTABLE_STEAL_CORES]
    return [
        f"- Host steal: up to {most['machine_cores']['stolen']:.2f} cores in one step "
        f"({most['system']} at {most['offered_per_s']:,.0f}/s); {len(noisy)} of the "
        f"{len(missed)} steps over budget but not overloaded ran while the host took "
        f"{NOTABLE_STEAL_CORES} cores or more (a miss there may be the machine's)."
    ]


def _mlserver_note(settings: dict) -> str:
    """How the MLServer baseline ran, for the reader of the report."""
    heap = ", its start-up heap frozen as headrace's workers do" if settings.get(
        "mlserver_freeze_heap") else ""  # fmt: skip
    return (
        "MLServer 1.7.1 in its Kafka mode, in its own environment: a custom runtime doing "
        "the same Feast read (`get_online_features` of the same service and SQLite store, "
        "once per batch, no cache) and the same ONNX run per adaptive batch (up to "
        f"{settings['max_batch_size']} events within {settings.get('mlserver_batch_time_ms')} "
        f"ms), inference inline (`parallel_workers: 0`){heap}. MLServer's Kafka mode reads "
        "V2 inference JSON, not Avro: it is sent the same events as V2 JSON (one input per "
        "field) and answers V2 JSON. Latency is measured as for the others, from each "
        "input's Kafka timestamp, which a shim hands to the runtime "
        "(`tools/bench/mlserver/serve.py`)."
    )


def _systems_markdown(systems: dict) -> list[str]:
    """Per sampled worker: where its Python time went, by stage and by function."""
    lines = []
    for name, info in systems.items():
        sampled = info.get("flame")
        if not sampled:
            continue
        cpu = sampled.get("cpu_us_per_event", {}).get("worker")
        lines += [
            "",
            f"## Where the {name} worker's time goes "
            f"({sampled['rate_per_s']:,.0f}/s"
            + (f", {cpu:.0f} µs CPU per event)" if cpu is not None else ")"),
            "",
            f"py-spy samples of the thread holding the GIL (flame graph: "
            f"`flame-{name}.svg`); native work without the GIL and idle time are not in "
            "these shares.",
            "",
            "| stage | share |",
            "|---|---|",
        ]
        lines += [f"| {stage} | {share:.1%} |" for stage, share in sampled["by_stage"].items()]
        lines += ["", "| function (self time) | share |", "|---|---|"]
        lines += [f"| `{frame}` | {share:.1%} |" for frame, share in sampled["top_functions"]]
    return lines


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
        ("mlserver", "tab:purple"),
        ("relay", "tab:olive"),
        ("kafka", "tab:gray"),
    )
    # Scenarios name their systems (e.g. swap-bare, swap-bare-shadow): default colours.
    others = dict.fromkeys(s.system for s in steps if s.system not in dict(systems))
    passes = sorted({s.pass_number for s in steps})
    for system, colour in (*systems, *((name, None) for name in others)):
        for number in passes:
            ours = [s for s in steps if s.system == system and s.pass_number == number
                    and s.latency.count]  # fmt: skip
            if not ours:
                continue
            rates = [s.offered_per_s for s in ours]
            label = system if number == 1 else f"{system} (pass {number})"
            shade = 1.0 if number == 1 else 0.45
            axes.plot(rates, [s.latency.p50_ms for s in ours], "-o", color=colour, alpha=shade,
                      label=f"{label} p50")  # fmt: skip
            axes.plot(rates, [s.latency.p99_ms for s in ours], "--s", color=colour,
                      alpha=shade, label=f"{label} p99")  # fmt: skip
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


def _plot_overload(steps: list[StepResult], budget_ms: float, path: Path) -> None:
    """Per runtime and load multiple: answers by status (bars) and the OK answers' p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [s for s in steps if s.multiple is not None]
    systems = sorted({s.system for s in ours})
    figure, axes = plt.subplots(
        1, max(len(systems), 1), figsize=(6 * max(len(systems), 1), 4.5), squeeze=False
    )
    colours = {"OK": "tab:green", "DEGRADED": "tab:orange", "SHED": "tab:red"}
    for axis, system in zip(axes[0], systems, strict=False):
        rows = sorted((s for s in ours if s.system == system), key=lambda s: s.multiple)
        labels = [f"{s.multiple:g}x\n{s.offered_per_s:.0f}/s" for s in rows]
        bottom = [0] * len(rows)
        for status, colour in colours.items():
            counts = [s.statuses.get(status, 0) for s in rows]
            axis.bar(labels, counts, bottom=bottom, color=colour, label=status)
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
        lost = [s.unanswered for s in rows]
        if any(lost):
            axis.bar(labels, lost, bottom=bottom, color="black", label="lost")
        axis.set_ylabel("answers in the measured window")
        axis.set_title(system)
        p99 = axis.twinx()
        p99.plot(
            labels,
            [s.by_status["OK"].p99_ms if "OK" in s.by_status else float("nan") for s in rows],
            "-o",
            color="tab:blue",
            label="OK p99",
        )
        p99.axhline(budget_ms, color="black", linewidth=0.8, linestyle=":", label="budget")
        p99.set_ylabel("OK p99 (ms)")
        p99.set_ylim(0, budget_ms * 1.5)
        handles = axis.get_legend_handles_labels()
        more = p99.get_legend_handles_labels()
        axis.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="upper left")
    figure.suptitle(
        f"Overload: answers by status and OK p99 per load multiple "
        f"({', '.join(f'{m:g}x' for m in OVERLOAD_MULTIPLES)} of capacity)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
