"""`headrace models deploy|promote|rollback|status`: the desired deployment of a
pipeline written to the control topic, and what each live worker reports it applied."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from models.registry import resolve_model, with_version
from schemas.errors import HeadraceError
from streams.config import HeadraceConfig, PipelineConfig
from streams.control import (
    Desired,
    Mode,
    Report,
    change_desired,
    desired_states,
    worker_reports,
)
from streams.errors import ConfigError
from streams.guardrail import Guardrail

# A worker silent for this many heartbeat intervals is reported gone.
_SILENT_BEATS = 3
_POLL_S = 0.5


def current(config: HeadraceConfig, spec: PipelineConfig) -> Desired:
    return desired_states(config).get(spec.name) or Desired(spec.name)


def _change(
    config: HeadraceConfig, spec: PipelineConfig, build: Callable[[Desired], Desired]
) -> Desired:
    """Write `build(current state)`. The current state is read inside `change_desired`'s
    fence: a command running at the same time on the pipeline fails (ConcurrentChange)
    instead of one of the two changes being lost."""
    return change_desired(config, spec.name, lambda: build(current(config, spec)))


def deploy(
    config: HeadraceConfig, spec: PipelineConfig, version: str, mode: Mode | None = None,
    canary_percent: float = 0.0, guardrail: Guardrail | None = None,
) -> Desired:  # fmt: skip
    """Serve `version` (or try it as a canary or shadow candidate, optionally with a
    guardrail that rolls it back). The version is looked up first (and downloaded, from
    MLflow), so a name that does not exist is refused here; whether it loads and fits
    the pipeline, each worker checks."""
    if mode == "canary" and not 0 < canary_percent < 100:
        raise ConfigError(f"--canary takes a percentage in (0, 100), got {canary_percent:g}")
    if guardrail is not None and mode is None:
        raise ConfigError("a guardrail watches a candidate; hint: add --canary PCT or --shadow")
    # An alias is written as the version it names now: workers already serving would
    # not see the alias move, workers started later would.
    resolved = resolve_model(with_version(spec.model, version)).version or version
    return _change(config, spec, lambda now: now.deploy(resolved, mode, canary_percent, guardrail))


def promote(config: HeadraceConfig, spec: PipelineConfig) -> Desired:
    return _change(config, spec, Desired.promote)


def rollback(config: HeadraceConfig, spec: PipelineConfig, reason: str = "rollback") -> Desired:
    return _change(config, spec, lambda now: now.rollback(reason))


def describe(desired: Desired) -> str:
    serving = desired.serving or "the config's model"
    text = f"serving {serving}"
    if desired.candidate is not None:
        share = f" {desired.canary_percent:g}%" if desired.mode == "canary" else ""
        text += f", candidate {desired.candidate} ({desired.mode}{share})"
    if desired.guardrail is not None:
        text += f", guarded by {_rule(desired.guardrail)}"
    return f"{text} [revision {desired.revision}, {desired.reason or 'initial'}]"


def _rule(rule: Guardrail) -> str:
    limits = [
        f"p99 +{rule.max_p99_increase_ms:g} ms" if rule.max_p99_increase_ms is not None else "",
        f"error rate {rule.max_error_rate:g}" if rule.max_error_rate is not None else "",
        f"score drift {rule.max_score_drift:g}" if rule.max_score_drift is not None else "",
    ]
    return f"{', '.join(limit for limit in limits if limit)} over {rule.window_s:g} s"


@dataclass(frozen=True)
class Applied:
    """What the live workers did with a desired state."""

    reports: list[Report]
    """Of the workers that acted on it."""
    pending: int
    """Live workers that had not acted on it yet."""
    refused: dict[str, dict[str, str]]
    """Worker -> {version it refused: why}, for the versions the desired state names."""


class NotApplied(HeadraceError):
    exit_status = 75  # EX_TEMPFAIL: the workers may still act on it


class Refused(HeadraceError):
    exit_status = 65  # EX_DATAERR: the version itself does not load or fit


def applied(
    config: HeadraceConfig, spec: PipelineConfig, desired: Desired, timeout_s: float
) -> Applied:
    """Waits (at most `timeout_s`) until every live worker of the pipeline acted on
    `desired`: switched to it, or refused what it names."""
    deadline = time.monotonic() + timeout_s
    # Live when the wait began: each must act on it. A worker loading a large version
    # sends no heartbeat meanwhile, so falling silent does not excuse it.
    expected: set[str] | None = None
    while True:
        reports = [r for r in worker_reports(config) if r.pipeline == spec.name]
        if expected is None:
            expected = {r.worker for r in reports if _live(config, r)}
        waited = [r for r in reports if r.worker in expected or _live(config, r)]
        done = [r for r in waited if r.revision >= desired.revision]
        if (waited and len(done) == len(waited)) or time.monotonic() >= deadline:
            named = {v for v in (desired.serving, desired.candidate) if v is not None}
            refused = {r.worker: {v: r.refused[v] for v in named if v in r.refused} for r in done}
            return Applied(
                done, len(waited) - len(done), {w: why for w, why in refused.items() if why}
            )
        time.sleep(_POLL_S)


def check_applied(found: Applied, desired: Desired, waited_s: float) -> None:
    """Raises unless every live worker applied `desired` (`deploy --wait`)."""
    if found.refused:
        reasons = sorted({why for refused in found.refused.values() for why in refused.values()})
        versions = sorted({v for refused in found.refused.values() for v in refused})
        raise Refused(
            f"pipeline {desired.pipeline}: v{', v'.join(versions)} refused by "
            f"{len(found.refused)} of {len(found.reports) + found.pending} workers "
            f"({'; '.join(reasons)}); they serve what they served; hint: "
            f"`headrace models rollback {desired.pipeline}` undoes the deploy"
        )
    if not found.reports and not found.pending:
        raise NotApplied(
            f"pipeline {desired.pipeline}: no live worker reported within {waited_s:g} s; "
            "hint: it stays desired, and a worker started later serves it from its first batch"
        )
    if found.pending:
        raise NotApplied(
            f"pipeline {desired.pipeline}: {found.pending} of "
            f"{len(found.reports) + found.pending} live workers had not applied revision "
            f"{desired.revision} after {waited_s:g} s; hint: it stays desired, every worker "
            "follows it; `headrace models status` shows where each stands"
        )


def report_line(report: Report) -> str:
    """What one worker serves, as its last heartbeat said."""
    text = f"{report.worker}: serving v{report.serving}"
    if report.candidate is not None:
        share = f" {report.canary_percent:g}%" if report.mode == "canary" else ""
        text += f", candidate v{report.candidate} ({report.mode}{share})"
    age_s = time.time() - report.sent_ms / 1000
    return f"{text}, revision {report.revision}, {age_s:.0f} s ago"


def _live(config: HeadraceConfig, report: Report) -> bool:
    silent_ms = _SILENT_BEATS * config.control.heartbeat_interval_s * 1000
    return time.time() * 1000 - report.sent_ms <= silent_ms


def status_lines(config: HeadraceConfig, spec: PipelineConfig) -> list[str]:
    """The desired state, then one line per worker that reported on the pipeline."""
    lines = [f"{spec.name}: desired {describe(current(config, spec))}"]
    reports = [r for r in worker_reports(config) if r.pipeline == spec.name]
    for report in sorted(reports, key=lambda r: r.worker):
        if not _live(config, report):
            age_s = time.time() - report.sent_ms / 1000
            lines.append(f"  {report.worker}: gone (last heard {age_s:.0f} s ago)")
            continue
        lines.append(f"  {report_line(report)}")
        for version, why in report.refused.items():
            lines.append(f"    refused v{version}: {why}")
    if not reports:
        lines.append("  no worker has reported")
    return lines
