"""The metrics that the Grafana dashboard and the Prometheus rules query, read from
their PromQL: each selector's metric name with the label names it matches on."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import yaml

from infra.java import INFRA_DIR

DASHBOARD = INFRA_DIR / "grafana" / "dashboards" / "headrace.json"
RULE_FILES = sorted((INFRA_DIR / "prometheus" / "rules").glob("*.yml"))

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
_LABEL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)")
_IDENTIFIER = re.compile(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)\b(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan"}  # fmt: skip


def selectors(expression: str) -> dict[str, set[str]]:
    """Metric name -> label names matched, of every selector in a PromQL expression."""
    text = expression.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    text = _GROUPING.sub(" ", text)
    found: dict[str, set[str]] = defaultdict(set)
    # Label matchers first (their values are strings, their names are not metrics).
    for match in _SELECTOR.finditer(_STRING.sub('""', text)):
        name, matchers = match.group(1), match.group(2)
        labels = {_LABEL.match(m).group(1) for m in matchers.split(",") if m.strip()}
        if name:
            found[name] |= labels
    text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", _STRING.sub('""', text))
    text = _RANGE.sub(" ", text)
    for match in _IDENTIFIER.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS:
            continue  # a function or aggregation, or an operator
        found[name] |= set()
    return dict(found)


def dashboard_expressions(path: Path = DASHBOARD) -> dict[str, str]:
    """Panel title and target -> PromQL of every dashboard query."""
    board = json.loads(path.read_text())
    return {
        f"{panel['title']} [{target['refId']}]": target["expr"]
        for panel in board["panels"]
        for target in panel.get("targets", [])
    }


def rule_expressions(paths: list[Path] = RULE_FILES) -> dict[str, str]:
    """Rule name -> PromQL of every recording and alerting rule."""
    found = {}
    for path in paths:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                found[f"{path.name}: {rule.get('alert') or rule['record']}"] = rule["expr"]
    return found


def recorded(paths: list[Path] = RULE_FILES) -> set[str]:
    """The series names the recording rules write."""
    return {
        rule["record"]
        for path in paths
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "record" in rule
    }
