"""A shadow candidate's answer says what the candidate answered: a NaN or infinite score
is no answer, never `OK` because the serving model answered the event in full."""

from __future__ import annotations

import math

import pytest

from streams.admit import NON_FINITE, Route
from streams.records import InputRecord, Item
from streams.shadow import as_answered


def served_in_full() -> Item:
    record = InputRecord("in", 0, 7, 0, b"k", b"v")
    return Item(record, None, 1.0, {"amount": 1.0}, route=Route.FULL)


@pytest.mark.parametrize("score", [math.nan, math.inf, -math.inf])
def test_a_candidate_answer_that_is_not_a_number_is_shed_with_its_reason(score):
    item = served_in_full()
    shown = as_answered(item, {"score": score, "label": False})
    assert (shown.route.status, shown.reason) == ("SHED", NON_FINITE)
    assert item.route is Route.FULL  # the serving answer's item is left as it is


def test_a_candidate_answer_that_is_a_number_keeps_the_serving_status():
    item = served_in_full()
    assert as_answered(item, {"score": 0.25, "label": False}) is item
    assert as_answered(item, {"value": 3.5}).route.status == "OK"
