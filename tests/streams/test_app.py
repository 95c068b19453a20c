"""What the worker refuses to start with, before anything is loaded."""

from __future__ import annotations

from pathlib import Path

from schemas.catalogue import load_schema
from streams.app import check_fields
from streams.config import PipelineConfig
from tools.deploy import sample_config


def spec_with(**input_changes) -> PipelineConfig:
    raw = sample_config("k:9092", Path("repo"), Path("m.onnx"))["pipelines"][0]
    raw["input"] = {**raw["input"], **input_changes}
    return PipelineConfig.model_validate(raw)


def test_fields_the_config_names_must_be_in_the_schema():
    (problem,) = check_fields(spec_with(event_id_field="txn_id"), load_schema("transaction.avsc"))
    assert "input.event_id_field 'txn_id' is not a field of the input schema" in problem


def test_the_event_time_field_must_be_a_number():
    schema = load_schema("transaction.avsc")
    assert check_fields(spec_with(event_time_field="event_time_ms"), schema) == []
    (problem,) = check_fields(spec_with(event_time_field="user_id"), schema)
    assert "must be a number (epoch milliseconds), its type is ['string']" in problem
