"""`headrace monitor`: the SLO rules for a target, and Debian's Prometheus run on a live
worker with every rule evaluating cleanly and every query answered by what it exports."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from infra.ports import free_port
from tests.helpers import PATIENT_BUDGET_MS, produce_events, wait_until
from tests.infra.queries import dashboard_expressions, recorded, rule_expressions, selectors

# The sample names a family of each type exposes.
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def headrace(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *arguments],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def api(url: str, path: str, **query: str) -> dict:
    address = f"{url}/api/v1/{path}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(address, timeout=5) as answer:
        return json.load(answer)["data"]


def test_monitor_rules_writes_the_rules_of_another_target(tmp_path):
    done = headrace("monitor", "rules", "--slo", "0.99", "--out", str(tmp_path / "slo.yml"))
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "slo.yml").read_text()
    assert "the SLO is 99% of" in text and "> 0.144" in text  # 14.4 x 1%
    assert headrace("monitor", "rules", "--slo", "1.5").returncode == 2


@pytest.mark.integration
def test_prometheus_scrapes_a_worker_and_every_rule_and_query_resolves(
    deploy, kafka, sample_assets, tmp_path
):
    metrics_port, web_port = free_port(), free_port()
    deployment = deploy(metrics_port=metrics_port, latency_budget_ms=PATIENT_BUDGET_MS)
    spec = deployment.spec
    state = tmp_path / "monitor"
    url = f"http://127.0.0.1:{web_port}"
    produce_events(kafka.bootstrap_servers, spec.input_topic, sample_assets.world, 300,
                   seed=8, prefix="monitor")  # fmt: skip
    with deployment.worker():
        try:
            started = headrace("monitor", "start", "--target", f"127.0.0.1:{metrics_port}",
                               "--port", str(web_port), "--scrape-interval", "1",
                               "--state-dir", str(state))  # fmt: skip
            assert started.returncode == 0, started.stdout + started.stderr
            assert url in started.stdout

            def lag_scraped() -> bool:
                found = api(url, "query", query="headrace_consumer_lag_records")["result"]
                return len(found) == 3

            assert wait_until(lag_scraped, 90), (
                api(url, "targets"),
                api(url, "query", query="headrace_consumer_lag_records"),
                deployment.log_tail(),
            )
            targets = api(url, "targets")["activeTargets"]
            assert [(t["labels"]["job"], t["health"]) for t in targets] == [("headrace", "up")]

            def evaluated() -> list:
                rules = [r for g in api(url, "rules")["groups"] for r in g["rules"]]
                return rules if all(r["health"] == "ok" for r in rules) else []

            rules = wait_until(evaluated, 30)
            assert rules, api(url, "rules")
            assert {r["name"] for r in rules} == {
                *recorded(),
                *(name.split(": ")[1] for name in rule_expressions() if "Headrace" in name),
            }
            assert all(not r.get("lastError") for r in rules)
            with urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout=5
            ) as answer:
                exposition = answer.read().decode()
        finally:
            stopped = headrace("monitor", "stop", "--state-dir", str(state))
    assert "prometheus stopped" in stopped.stdout
    # No dead panel or rule: every metric queried is one the running worker exports.
    exported = {
        family.name + suffix
        for family in text_string_to_metric_families(exposition)
        for suffix in SUFFIXES.get(family.type, ("",))
    }
    queried = {
        name
        for expression in [*dashboard_expressions().values(), *rule_expressions().values()]
        for name in selectors(expression)
    }
    assert queried - exported - recorded() - {"up"} == set()
