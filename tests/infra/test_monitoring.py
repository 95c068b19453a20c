"""The Prometheus rules and the Grafana dashboard: promtool checks and runs the rules'
unit tests, the SLO file is its template's output, and every query names a metric the
worker registers, with labels it has."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from infra.java import INFRA_DIR
from tests.infra.queries import (
    RULE_FILES,
    dashboard_expressions,
    recorded,
    rule_expressions,
    selectors,
)
from tools.monitor import SLO_FILE, slo_rules

RULE_TESTS = sorted((INFRA_DIR / "prometheus" / "tests").glob("*_test.yml"))
# Series Prometheus makes itself for each scrape target, and the target's labels.
SCRAPE_SERIES = {"up": {"job", "instance"}}
TARGET_LABELS = {"job", "instance"}


def promtool(*arguments: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed; hint: apt-get install prometheus (./run does)")
    return subprocess.run(
        [binary, *arguments], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def test_the_rule_files_are_valid():
    done = promtool("check", "rules", *map(str, RULE_FILES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {path.name for path in RULE_FILES} == {"alerts.yml", "slo.yml"}


def test_the_rules_pass_their_unit_tests():
    done = promtool("test", "rules", *(path.name for path in RULE_TESTS), cwd=RULE_TESTS[0].parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == len(RULE_TESTS)


def test_every_alert_has_cases_that_must_fire_and_that_must_not():
    alerts = {
        rule["alert"]
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    fires, stays_quiet = set(), set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            series = " ".join(s["series"] for s in case["input_series"])
            for check in case.get("alert_rule_test", []):
                expected = check.get("exp_alerts") or []
                if expected:
                    fires.add(check["alertname"])
                firing = {tuple(sorted(a["exp_labels"].items())) for a in expected}
                # Quiet: nothing expected, or a series of the case that is not among them.
                if not expected or len(firing) < series.count("{"):
                    stays_quiet.add(check["alertname"])
    assert alerts - fires == set(), "alerts never tested firing"
    assert alerts - stays_quiet == set(), "alerts never tested staying quiet"


def test_the_slo_rules_are_the_template_at_999_and_another_target_is_valid(tmp_path):
    assert SLO_FILE.read_text() == slo_rules(0.999), "regenerate: headrace monitor rules --out"
    other = tmp_path / "slo.yml"
    other.write_text(slo_rules(0.995))
    done = promtool("check", "rules", str(other))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "> 0.072" in other.read_text()  # 14.4 x 0.5%
    with pytest.raises(ValueError, match="between 0 and 1"):
        slo_rules(99.9)


def test_the_query_reader_finds_metrics_and_their_label_matchers():
    found = selectors(
        'histogram_quantile(0.99, sum by (le, pipeline) (rate(a_bucket{status="x,y}",'
        ' job!~"j"}[$__rate_interval]))) > 1e-3 and on (pipeline) group_left (model) b'
        " or c:d:e offset 5m unless sum without (x) (rate(f_total[1h]))"
    )
    assert found == {"a_bucket": {"status", "job"}, "b": set(), "c:d:e": set(), "f_total": set()}


def worker_metrics() -> dict[str, set[str]]:
    """Sample name -> label names of every metric a worker process registers."""
    # The worker's modules register their metrics on import.
    import streams.app
    import streams.consumers.confluent
    import streams.consumers.faust  # noqa: F401

    found = {}
    for collector, names in REGISTRY._collector_to_names.items():
        labels = set(getattr(collector, "_labelnames", ()))
        for name in names:
            found[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return found


@pytest.mark.parametrize(
    "source", ["dashboard", "rules"], ids=["grafana dashboard", "prometheus rules"]
)
def test_every_query_names_a_metric_the_worker_registers(source):
    expressions = dashboard_expressions() if source == "dashboard" else rule_expressions()
    exported = {**worker_metrics(), **SCRAPE_SERIES}
    rules = recorded()
    problems = []
    for where, expression in expressions.items():
        for name, labels in selectors(expression).items():
            if name in rules:
                continue
            if name not in exported:
                problems.append(f"{where}: {name} is not a metric the worker exports")
            elif unknown := labels - exported[name] - TARGET_LABELS:
                problems.append(f"{where}: {name} has no label {sorted(unknown)}")
    assert problems == []
    assert len(expressions) > 10
