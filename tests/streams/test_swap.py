"""ModelSwitcher with fake pools: what a worker reports and serves when a version does
not load or a deploy fails after, and which versions' series it exports."""

from __future__ import annotations

import json

import pytest
from prometheus_client import REGISTRY, generate_latest

from streams import swap
from streams.control import Desired
from streams.guardrail import Guardrail
from tests.streams.test_pipeline import FIELDS, STORE, FakePool, pipeline

BROKEN = "5"
CLOSED: list[str] = []
"""The versions whose pools were closed, in order."""
FAILING_CLOSE: set[str] = set()


class Pool(FakePool):
    """A registry version's pool; version 5 fails as a full disk or a stale NFS handle."""

    def __init__(self, config, _sizes) -> None:
        if config.version == BROKEN:
            raise OSError(116, "Stale file handle")
        super().__init__("full", ("amount", *STORE), 0.5, version=config.version)

    def close(self) -> None:
        CLOSED.append(self.signature.version)
        if self.signature.version in FAILING_CLOSE:
            raise OSError(5, "Input/output error")


@pytest.fixture
def switcher(monkeypatch):
    monkeypatch.setattr(swap, "SessionPool", Pool)
    monkeypatch.setattr(swap, "resolve_model", lambda config: config)
    monkeypatch.setattr(swap, "_QUIET_S", 0.01)
    # Retired models are closed; the config's fake has nothing to close.
    monkeypatch.setattr(FakePool, "close", lambda _pool: None, raising=False)
    CLOSED.clear()
    FAILING_CLOSE.clear()
    built, _ = pipeline()
    switcher = swap.ModelSwitcher()
    switcher.add(built, FIELDS, STORE)
    configured = built.serving
    yield switcher, built
    switcher.close()
    # The metrics are the process's: leave the model-info series as a fresh pipeline sets it.
    built.use(configured)


def test_a_version_failing_with_an_os_error_is_reported_refused(switcher):
    switcher, built = switcher
    served = Desired("fraud").deploy("2", None, 0)
    assert switcher.apply(served)
    assert not switcher.apply(served.deploy(BROKEN, None, 0))
    [report] = switcher.reports()
    assert (report.serving, report.revision) == ("2", 2)
    assert "OSError" in report.refused[BROKEN] and "Stale file handle" in report.refused[BROKEN]
    assert built.model.signature.version == "2"


def test_a_refused_canary_leaves_the_serving_untouched(switcher):
    switcher, built = switcher
    served = Desired("fraud").deploy("2", None, 0)
    assert switcher.apply(served)
    before = built.serving
    assert not switcher.apply(served.deploy(BROKEN, "canary", 10))
    assert built.serving is before  # not switched: no "now serving", guardrail clock kept
    [report] = switcher.reports()
    assert (report.candidate, report.mode, report.canary_percent) == (None, None, 0.0)
    assert BROKEN in report.refused


def _series(version: str) -> list[str]:
    """The exported samples of the test pipeline that carry `version`."""
    text = generate_latest(REGISTRY).decode()
    label = f'version="{version}"'
    return [line for line in text.splitlines() if 'pipeline="fraud"' in line and label in line]


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"pipeline": "fraud", **labels})


def test_a_retired_version_leaves_no_series_and_the_live_ones_keep_theirs(switcher):
    # Versions of their own: the registry is the process's, shared with other tests.
    switcher, built = switcher
    first = Desired("fraud").deploy("101", None, 0)
    assert switcher.apply(first)
    built.serving.meter.record(0.01, [{"score": 0.5}])
    second = first.deploy("102", None, 0)
    assert switcher.apply(second)
    assert _series("101") == []
    built.serving.meter.record(0.01, [{"score": 0.5}] * 2)
    canary = second.deploy("103", "canary", 10)
    assert switcher.apply(canary)
    built.serving.candidate_meter.record(0.01, [{"score": 0.25}])
    assert _value("headrace_model_answers_total", version="102", result="ok") == 2
    assert _value("headrace_serving_version_info", role="canary", version="103") == 1

    assert switcher.apply(canary.promote())  # 103 serves, 102 leaves
    assert _series("101") == [] and _series("102") == []
    assert _value("headrace_model_answers_total", version="103", result="ok") == 1
    assert _value("headrace_serving_version_info", role="serving", version="103") == 1
    assert _value("headrace_serving_version_info", role="canary", version="103") is None
    assert CLOSED == ["101", "102"]

    # Deployed again, a retired version exports again, counting from its return.
    assert switcher.apply(canary.promote().deploy("101", None, 0))
    built.serving.meter.record(0.01, [{"score": 0.5}])
    assert _value("headrace_model_answers_total", version="101", result="ok") == 1
    assert _value("headrace_serving_version_info", role="serving", version="101") == 1
    assert _series("103") == []


def _with_canary_percent(desired: Desired, percent) -> Desired:
    """`desired` as another tool might write it: it parses, with a percent of `percent`."""
    raw = json.loads(desired.to_json())
    raw["canary_percent"] = percent
    return Desired.from_json(json.dumps(raw).encode())


def test_a_deploy_failing_after_its_version_loaded_is_refused_and_undone(switcher):
    switcher, built = switcher
    served = Desired("fraud").deploy("2", None, 0)
    assert switcher.apply(served)
    before = built.serving
    malformed = _with_canary_percent(served.deploy("3", "canary", 10), None)
    assert not switcher.apply(malformed)  # v3 loads; building its canary split fails
    assert built.serving is before
    [report] = switcher.reports()
    assert (report.serving, report.candidate, report.revision) == ("2", None, 2)
    assert "revision 2 failed: TypeError" in report.refused["3"]
    assert CLOSED == ["3"]  # nothing loaded for it stays open


def test_a_switch_that_fails_keeps_the_previous_state_and_reports_it_refused(switcher, monkeypatch):
    switcher, built = switcher
    canary = Desired("fraud").deploy("2", None, 0).deploy("4", "canary", 5)
    assert switcher.apply(canary)
    before = built.serving

    def failing_use(_serving):
        raise RuntimeError("the switch failed")

    monkeypatch.setattr(built, "use", failing_use)
    deploy = canary.deploy("6", None, 0)
    assert not switcher.apply(deploy)
    assert built.serving is before
    [report] = switcher.reports()
    assert (report.serving, report.candidate, report.canary_percent) == ("2", "4", 5.0)
    assert report.revision == deploy.revision
    assert "RuntimeError: the switch failed" in report.refused["6"]
    assert CLOSED == ["6"]
    assert _value("headrace_serving_version_info", role="serving", version="6") is None

    monkeypatch.delattr(built, "use")  # mended: the same deploy applies
    assert switcher.apply(deploy)
    [report] = switcher.reports()
    assert (report.serving, report.candidate, report.refused) == ("6", None, {})


def test_a_deploy_failing_once_switched_is_switched_back(switcher, monkeypatch):
    switcher, built = switcher
    served = Desired("fraud").deploy("2", None, 0)
    assert switcher.apply(served)
    before = built.serving
    export = swap._export

    def export_failing_to_switch(pipeline, old, new):
        if new is not before:  # the switch's export fails, the one switching back works
            raise RuntimeError("export failed")
        export(pipeline, old, new)

    monkeypatch.setattr(swap, "_export", export_failing_to_switch)
    assert not switcher.apply(served.deploy("7", None, 0))
    assert built.serving is before
    [report] = switcher.reports()
    assert (report.serving, report.revision) == ("2", 2)
    assert "RuntimeError: export failed" in report.refused["7"]
    assert CLOSED == ["7"]  # once the batches it took were done
    assert _series("7") == []  # it answered for an instant: its meter's series go too
    assert _value("headrace_serving_version_info", role="serving", version="2") == 1


def test_a_guardrail_rollback_after_a_refused_deploy_outranks_it(switcher):
    switcher, built = switcher
    rule = Guardrail(max_error_rate=0.1, min_answers=1)
    canary = Desired("fraud").deploy("2", None, 0).deploy("3", "canary", 10, rule)
    assert switcher.apply(canary)
    malformed = _with_canary_percent(canary.deploy("4", "canary", 10), "ten")
    assert not switcher.apply(malformed)
    built.serving.meter.record(0.01, [{"score": 0.5}])
    built.serving.candidate_meter.failed(5)
    [rollback] = switcher.guard()
    # Written as revision 3, the control follower would drop it: it has seen revision 3.
    assert rollback.revision == malformed.revision + 1
    assert (rollback.serving, rollback.candidate) == ("2", None)


def test_a_retired_pool_that_fails_to_close_does_not_undo_the_switch(switcher):
    switcher, _built = switcher
    served = Desired("fraud").deploy("2", None, 0)
    assert switcher.apply(served)
    FAILING_CLOSE.add("2")
    assert switcher.apply(served.deploy("3", None, 0))
    [report] = switcher.reports()
    assert (report.serving, report.revision, report.refused) == ("3", 2, {})
    assert CLOSED == ["2"]
