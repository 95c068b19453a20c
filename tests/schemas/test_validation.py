"""Declarative validation rules: each rule refuses what it should and names itself; rules
that do not fit the schema are refused when compiled."""

from __future__ import annotations

import pytest

from schemas.catalogue import load_schema
from schemas.config import FieldRules, InputConfig
from schemas.errors import SchemaFileError
from schemas.validation import EventRules, InvalidEventError
from tests.schemas.test_codec import EVENT

TRANSACTION = load_schema("transaction.avsc")


def rules(validate: dict) -> EventRules:
    config = InputConfig.model_validate({"schema": "t.avsc", "validate": validate})
    return EventRules(config.validate_fields, TRANSACTION)


@pytest.mark.parametrize(
    ("validate", "change", "rule"),
    [
        ({"user_id": ["non_empty"]}, {"user_id": ""}, "user_id.non_empty"),
        ({"amount": {"min": 0}}, {"amount": -1.0}, "amount.min"),
        ({"amount": {"min": 0}}, {"amount": float("nan")}, "amount.min"),
        ({"amount": {"finite": True}}, {"amount": float("inf")}, "amount.finite"),
        ({"hour_of_day": {"max": 23}}, {"hour_of_day": 24}, "hour_of_day.max"),
        ({"priority": ["required"]}, {"priority": None}, "priority.required"),
        ({"merchant_id": {"one_of": ["m1", "m2"]}}, {}, "merchant_id.one_of"),
    ],
)
def test_a_failing_rule_is_named(validate, change, rule):
    with pytest.raises(InvalidEventError) as caught:
        rules(validate).check({**EVENT, **change})
    assert caught.value.reason == "invalid_field"
    assert f"{caught.value.field}.{caught.value.rule}" == rule
    assert rule.split(".")[1] in str(caught.value)


def test_a_valid_event_passes_every_rule():
    rules(
        {
            "event_id": ["required", "non_empty"],
            "amount": {"finite": True, "min": 0, "max": 1e6},
            "hour_of_day": {"min": 0, "max": 23},
            "merchant_id": {"one_of": ["m000001"]},
            "priority": {"min": 0},  # an optional field is checked only when present
        }
    ).check(EVENT)


def test_rules_that_do_not_fit_the_schema_are_all_listed():
    with pytest.raises(SchemaFileError) as caught:
        rules({"nope": ["required"], "user_id": {"min": 0}, "amount": ["non_empty"]})
    message = str(caught.value)
    assert "'nope', not a field of Transaction" in message
    assert "validate.user_id.min does not fit" in message
    assert "validate.amount.non_empty does not fit" in message


def test_min_above_max_is_refused():
    with pytest.raises(ValueError, match="above max"):
        FieldRules(min=5, max=1)


def test_a_field_a_model_takes_as_float32_must_fit_in_float32():
    checked = EventRules({}, TRANSACTION, float32_fields=["amount"])
    checked.check({"amount": 3.0e38})
    checked.check({"amount": None})
    with pytest.raises(InvalidEventError) as failed:
        checked.check({"amount": 1e308})
    assert (failed.value.field, failed.value.rule, failed.value.reason) == (
        "amount", "float32", "invalid_field",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("rule", "value"),
    [({"min": 0}, "12"), ({"max": 10}, "12"), (["finite"], "nan"), (["non_empty"], 12.0)],
)
def test_a_value_a_rule_cannot_compare_breaks_it(rule, value):
    # A union field may hold a string where `min` wants a number: a dead letter naming
    # the rule, never a crash (which would stop the partition on that record).
    schema = {"type": "record", "name": "Reading", "fields": [
        {"name": "level", "type": ["null", "string", "double"]},
    ]}  # fmt: skip
    config = InputConfig.model_validate({"schema": "r.avsc", "validate": {"level": rule}})
    with pytest.raises(InvalidEventError) as caught:
        EventRules(config.validate_fields, schema).check({"level": value})
    assert caught.value.reason == "invalid_field" and caught.value.field == "level"
