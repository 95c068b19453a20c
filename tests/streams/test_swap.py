"""ModelSwitcher with fake pools: what a worker reports and serves when a version does
not load."""

from __future__ import annotations

import pytest

from streams import swap
from streams.control import Desired
from tests.streams.test_pipeline import FIELDS, STORE, FakePool, pipeline

BROKEN = "5"


class Pool(FakePool):
    """A registry version's pool; version 5 fails as a full disk or a stale NFS handle."""

    def __init__(self, config, _sizes) -> None:
        if config.version == BROKEN:
            raise OSError(116, "Stale file handle")
        super().__init__("full", ("amount", *STORE), 0.5, version=config.version)


@pytest.fixture
def switcher(monkeypatch):
    monkeypatch.setattr(swap, "SessionPool", Pool)
    monkeypatch.setattr(swap, "resolve_model", lambda config: config)
    monkeypatch.setattr(swap, "_QUIET_S", 0.01)
    # Retired models are closed; the config's fake has nothing to close.
    monkeypatch.setattr(FakePool, "close", lambda _pool: None, raising=False)
    built, _ = pipeline()
    switcher = swap.ModelSwitcher()
    switcher.add(built, FIELDS, STORE)
    yield switcher, built
    switcher.close()


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
