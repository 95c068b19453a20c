"""The canary split and the desired-state transitions (pure logic)."""

from __future__ import annotations

import pytest

from streams.control import Desired
from streams.errors import ConfigError
from streams.records import InputRecord, Item
from streams.serving import Serving


def _items(keys):
    return [Item(InputRecord("t", 0, i, 0, key, b""), None, 0.0) for i, key in enumerate(keys)]


def test_canary_share_is_within_a_point_and_sticky_per_key():
    serving = Serving(model=object(), candidate=object(), mode="canary", canary_percent=10)
    keys = [f"u{n:07d}".encode() for n in range(10_000)]
    _, canary = serving.split(_items(keys))
    assert 0.09 <= len(canary) / len(keys) <= 0.11
    again = {item.record.key for item in serving.split(_items(reversed(keys)))[1]}
    assert again == {item.record.key for item in canary}


def test_keyless_records_are_answered_by_the_serving_model():
    serving = Serving(model=object(), candidate=object(), mode="canary", canary_percent=10)
    served, canary = serving.split(_items([None, b""] * 50))
    assert len(served) == 100 and canary == []


def test_a_canary_without_a_candidate_is_no_canary():
    model = object()
    refused = Serving(model, None, "canary", 10)
    assert not refused.canary and refused.canary_buckets == 0 and refused.mode is None
    plain = Serving(model)
    assert (refused.model, refused.candidate, refused.mode, refused.canary_buckets) == (
        plain.model, plain.candidate, plain.mode, plain.canary_buckets,
    )  # fmt: skip


def test_deploy_promote_rollback():
    desired = Desired("fraud").deploy("2", None, 0)
    assert (desired.serving, desired.previous, desired.revision) == ("2", None, 1)
    canary = desired.deploy("3", "canary", 10)
    assert (canary.serving, canary.candidate, canary.canary_percent) == ("2", "3", 10)
    assert canary.rollback().candidate is None and canary.rollback().serving == "2"
    promoted = canary.promote()
    assert (promoted.serving, promoted.previous, promoted.candidate) == ("3", "2", None)
    assert promoted.rollback().serving == "2"
    with pytest.raises(ConfigError, match="no candidate"):
        promoted.promote()
    assert Desired.from_json(promoted.to_json()) == promoted


def test_redeploying_the_served_version_keeps_what_rollback_returns_to():
    desired = Desired("fraud").deploy("2", None, 0).deploy("3", None, 0)
    again = desired.deploy("3", None, 0)
    assert (again.serving, again.previous, again.revision) == ("3", "2", 3)
    assert again.rollback().serving == "2"
