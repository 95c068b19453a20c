"""Capacity planning and scale-out, from the sweep's sustainable rate (nothing lost, 99%
answered in full, p99 within the budget; see `Bench._sweep`).

- `capacity`: one worker's sustainable rate for the bench's pipeline, per runtime, and
  what a target input rate needs (`plan`):
    workers       = ceil(target / (rate x headroom))
    partitions    = 2 x workers: an even share for each worker at the target, and room
                    for KEDA to double them (maxReplicaCount = partitions)
    lagThreshold  = rate x latency budget x headroom: the lag one worker works off
                    within the budget while it keeps room (infra/k8s/base/scaledobject.yaml)
- `scaleout`: the sustainable rate of 1, 2 and 3 workers of one group sharing the input
  partitions, with the cores each process used at that rate and the partitions each
  worker held. Where the processes used (nearly) all of the machine's cores, the report
  says the machine, not the workers, bounds the sum.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from tools.bench.harness import SWEEP_WORKER_BUDGET_MS, Bench, StepResult

SCALEOUT_WORKERS = (1, 2, 3)
# Targets planned for when none is given: these multiples of one worker's rate.
TARGET_MULTIPLES = (1, 2, 5, 10)
# The machine bounds a sum when its processes used at least this share of its cores.
MACHINE_BOUND_SHARE = 0.8


@dataclass(frozen=True)
class Plan:
    target_per_s: float
    workers: int
    partitions: int
    lag_threshold: int


def plan(rate_per_s: float, target_per_s: float, budget_s: float, headroom: float) -> Plan:
    """Workers, input partitions and KEDA's lagThreshold for `target_per_s`, given one
    worker's sustainable rate; see the module docstring for the formulas."""
    if rate_per_s <= 0:
        raise ValueError(f"expected a worker's sustainable rate above 0/s, got {rate_per_s}")
    planned_per_s = rate_per_s * headroom
    workers = max(1, math.ceil(target_per_s / planned_per_s))
    return Plan(target_per_s, workers, 2 * workers, max(1, round(planned_per_s * budget_s)))


def capacity(bench: Bench) -> tuple[dict, list[StepResult]]:
    """One worker's sweep per runtime, and the plan for the target (or a few) from it."""
    settings = bench.settings
    budget_s = SWEEP_WORKER_BUDGET_MS / 1000
    found, steps = {}, []
    for runtime in settings.runtimes:
        name = f"capacity-{runtime}"
        steps += bench.sweep_workers(name, runtime)
        rate = bench.systems[name]["sustainable_per_s"]
        targets = (settings.target_per_s,) if settings.target_per_s else tuple(
            multiple * rate for multiple in TARGET_MULTIPLES)  # fmt: skip
        plans = (
            [asdict(plan(rate, t, budget_s, settings.headroom)) for t in targets] if rate else []
        )
        found[runtime] = {"sustainable_per_s": rate, "plans": plans}
        bench.echo(f"  {runtime}: one worker sustains {rate:,.0f}/s")
    return {"budget_s": budget_s, "headroom": settings.headroom, "runtimes": found}, steps


def scaleout(bench: Bench) -> tuple[dict, list[StepResult]]:
    """The sweep of 1, 2 and 3 workers of one group per runtime, with each process's
    cores at the sustainable rate."""
    found, steps = {}, []
    for runtime in bench.settings.runtimes:
        rows = []
        for count in SCALEOUT_WORKERS:
            name = f"scaleout-{runtime}-{count}"
            swept = bench.sweep_workers(name, runtime, workers=count)
            steps += swept
            summary = bench.systems[name]
            rate = summary["sustainable_per_s"]
            at_rate = [s for s in swept if s.within_budget and s.offered_per_s == rate]
            cores = at_rate[-1].cpu_cores if at_rate else {}
            rows.append({"workers": count, "sustainable_per_s": rate, "cores": cores,
                         "partitions_per_worker": summary["partitions_per_worker"]})  # fmt: skip
            bench.echo(f"  {runtime} x{count}: {rate:,.0f}/s, cores {_cores(cores)}")
        found[runtime] = rows
    return {"machine_cores": os.cpu_count(), "partitions": bench.settings.partitions,
            "runtimes": found}, steps  # fmt: skip


def markdown(doc: dict) -> list[str]:
    """The report's section for the capacity or scale-out scenario (`doc` as
    `write_reports` builds it)."""
    if doc.get("capacity"):
        return _capacity_lines(doc["capacity"], doc["settings"]["budget_ms"])
    return _scaleout_lines(doc["scaleout"])


def _capacity_lines(found: dict, p99_bound_ms: float) -> list[str]:
    budget_ms, headroom = found["budget_s"] * 1000, found["headroom"]
    lines = ["## Capacity", "",
             f"One worker's sustainable rate: the highest offered rate with nothing lost, 99% "
             f"answered in full and p99 within {p99_bound_ms:.0f} ms. The plan uses "
             f"{headroom:.0%} of it per worker (headroom), partitions = 2 x workers (an even "
             f"share each, room for KEDA to double them: maxReplicaCount = partitions), and "
             f"KEDA's lagThreshold = rate x latency budget ({budget_ms:.0f} ms) x headroom.",
             ""]  # fmt: skip
    for runtime, info in found["runtimes"].items():
        rate = info["sustainable_per_s"]
        lines.append(f"### {runtime} runtime: one worker sustains {rate:,.0f} events/s")
        lines.append("")
        if not info["plans"]:
            lines += ["No rate passed: no plan.", ""]
            continue
        lines += ["| target/s | workers | input partitions | lagThreshold |", "|---|---|---|---|"]
        for p in info["plans"]:
            lines.append(f"| {p['target_per_s']:,.0f} | {p['workers']} | {p['partitions']} "
                         f"| {p['lag_threshold']} |")  # fmt: skip
        lines.append("")
    return lines


def _scaleout_lines(found: dict) -> list[str]:
    machine = found["machine_cores"]
    lines = ["## Scale-out", "",
             f"Workers of one group over {found['partitions']} input partitions, each count "
             f"swept like one worker. Cores: mean cores each process used during the step at "
             f"the sustainable rate (this machine has {machine}).", "",
             "| workers | partitions each | sustainable/s | per worker | cores per worker "
             "| broker | load generator | all of them |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for runtime, rows in found["runtimes"].items():
        one = rows[0]["sustainable_per_s"] if rows else 0
        for row in rows:
            cores, rate = _processes(row["cores"]), row["sustainable_per_s"]
            workers = [v for k, v in sorted(cores.items()) if k.startswith("worker")]
            lines.append(
                f"| {row['workers']} ({runtime}) | {row['partitions_per_worker']} | {rate:,.0f} "
                f"| {rate / row['workers']:,.0f} | {', '.join(f'{c:.2f}' for c in workers)} "
                f"| {cores.get('broker', 0):.2f} | {cores.get('load generator', 0):.2f} "
                f"| {sum(cores.values()):.2f} |"
            )
        lines += ["", _bound_sentence(runtime, rows, one, machine)]
    return lines


def _bound_sentence(runtime: str, rows: list[dict], one_per_s: float, machine: int) -> str:
    """Says what bounds the sum of the largest count, from the figures."""
    last = rows[-1]
    if not one_per_s or not last["sustainable_per_s"]:
        return f"{runtime}: a count sustained no rate within the budget here: no comparison."
    used = sum(_processes(last["cores"]).values())
    ratio = last["sustainable_per_s"] / one_per_s
    said = (f"{runtime}: {last['workers']} workers sustain {ratio:.2f}x one worker's rate "
            f"({last['sustainable_per_s']:,.0f}/s against {one_per_s:,.0f}/s), using "
            f"{used:.2f} of the machine's {machine} cores (workers, broker and load "
            "generator).")  # fmt: skip
    if used >= MACHINE_BOUND_SHARE * machine:
        return (said + " The machine, not headrace, bounds the sum here: the processes "
                "use all of its cores, so more workers only share them. On a machine with "
                "a core per worker the sum grows with the workers.")  # fmt: skip
    return said + (
        " These processes did not use all its cores: the workers bound the sum, "
        "or other load on the machine took the rest."
    )


def _processes(cores: dict[str, float]) -> dict[str, float]:
    """Each process's cores, without a worker's split by thread ("worker/loop"; it is in
    the steps table), which would count that worker twice."""
    return {name: value for name, value in cores.items() if "/" not in name}


def _cores(cores: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.2f}" for name, value in sorted(_processes(cores).items()))
