"""`headrace models deploy|promote|rollback|status`: the desired deployment of a
pipeline written to the control topic, and what each live worker reports it applied."""

from __future__ import annotations

import time

from models.registry import resolve_model, with_version
from streams.config import HeadraceConfig, PipelineConfig
from streams.control import Desired, Mode, desired_states, worker_reports, write_desired
from streams.errors import ConfigError
from streams.guardrail import Guardrail

# A worker silent for this many heartbeat intervals is reported gone.
_SILENT_BEATS = 3


def current(config: HeadraceConfig, spec: PipelineConfig) -> Desired:
    return desired_states(config).get(spec.name) or Desired(spec.name)


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
    resolve_model(with_version(spec.model, version))
    desired = current(config, spec).deploy(version, mode, canary_percent, guardrail)
    write_desired(config, desired)
    return desired


def promote(config: HeadraceConfig, spec: PipelineConfig) -> Desired:
    desired = current(config, spec).promote()
    write_desired(config, desired)
    return desired


def rollback(config: HeadraceConfig, spec: PipelineConfig, reason: str = "rollback") -> Desired:
    desired = current(config, spec).rollback(reason)
    write_desired(config, desired)
    return desired


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


def status_lines(config: HeadraceConfig, spec: PipelineConfig) -> list[str]:
    """The desired state, then one line per worker that reported on the pipeline."""
    lines = [f"{spec.name}: desired {describe(current(config, spec))}"]
    now_ms = time.time() * 1000
    silent_ms = _SILENT_BEATS * config.control.heartbeat_interval_s * 1000
    reports = [r for r in worker_reports(config) if r.pipeline == spec.name]
    for report in sorted(reports, key=lambda r: r.worker):
        age_s = (now_ms - report.sent_ms) / 1000
        if now_ms - report.sent_ms > silent_ms:
            lines.append(f"  {report.worker}: gone (last heard {age_s:.0f} s ago)")
            continue
        text = f"  {report.worker}: serving v{report.serving}"
        if report.candidate is not None:
            share = f" {report.canary_percent:g}%" if report.mode == "canary" else ""
            text += f", candidate v{report.candidate} ({report.mode}{share})"
        text += f", revision {report.revision}, {age_s:.0f} s ago"
        lines.append(text)
        for version, why in report.refused.items():
            lines.append(f"    refused v{version}: {why}")
    if not reports:
        lines.append("  no worker has reported")
    return lines
