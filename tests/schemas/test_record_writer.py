"""The compiled Avro writer writes exactly fastavro's bytes, and hands fastavro what
it was not built for."""

from __future__ import annotations

import io
import math

import fastavro
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.answer import answer_schema
from schemas.catalogue import LocalCatalogue, load_schema
from schemas.codec import AvroEncoder
from schemas.record_writer import _MAX_KNOWN_STRINGS, _Strings, compile_writer

RICH = {
    "type": "record",
    "name": "Rich",
    "namespace": "test.rich",
    "fields": [
        {"name": "flag", "type": "boolean"},
        {"name": "small", "type": "int"},
        {"name": "big", "type": "long"},
        {"name": "ratio", "type": "float"},
        {"name": "precise", "type": "double"},
        {"name": "text", "type": "string"},
        {"name": "blob", "type": "bytes"},
        {"name": "nothing", "type": "null"},
        {"name": "maybe_text", "type": ["null", "string"]},
        {"name": "text_or_null", "type": ["string", "null"]},
        {"name": "colour", "type": {"type": "enum", "name": "Colour", "symbols": ["RED", "GREEN"]}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "counts", "type": {"type": "map", "values": "long"}},
        {"name": "inner", "type": {"type": "record", "name": "Inner", "fields": [
            {"name": "label", "type": "string"}, {"name": "weight", "type": "float"}]}},
        {"name": "inners", "type": {"type": "array", "items": "Inner"}},
        {"name": "maybe_inner", "type": ["null", "test.rich.Inner"]},
        {"name": "second_colour", "type": "Colour"},
    ],
}  # fmt: skip

floats32 = st.floats(width=32, allow_nan=False)
texts = st.text(max_size=20)
inner = st.fixed_dictionaries({"label": texts, "weight": floats32})
rich_values = st.fixed_dictionaries(
    {
        "flag": st.booleans(),
        "small": st.integers(-(2**31), 2**31 - 1),
        "big": st.integers(-(2**63), 2**63 - 1),
        "ratio": floats32 | st.integers(-1000, 1000),
        "precise": st.floats(allow_nan=False),
        "text": texts,
        "blob": st.binary(max_size=20),
        "nothing": st.none(),
        "maybe_text": st.none() | texts,
        "text_or_null": st.none() | texts,
        "colour": st.sampled_from(["RED", "GREEN"]),
        "tags": st.lists(texts, max_size=4),
        "counts": st.dictionaries(texts, st.integers(-(2**63), 2**63 - 1), max_size=3),
        "inner": inner,
        "inners": st.lists(inner, max_size=3),
        "maybe_inner": st.none() | inner,
        "second_colour": st.sampled_from(["RED", "GREEN"]),
    }
)


def fastavro_bytes(schema: dict, record: dict) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def compiled_bytes(schema: dict, record: dict) -> bytes:
    write = compile_writer(schema)
    assert write is not None
    out = bytearray()
    write(out, record)
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(rich_values)
def test_every_covered_type_is_written_as_fastavro_writes_it(record):
    assert compiled_bytes(RICH, record) == fastavro_bytes(RICH, record)


@pytest.mark.parametrize("task", ["binary", "multiclass", "regression"])
def test_answer_schemas_compile_and_match_fastavro(task):
    schema = answer_schema(load_schema("transaction.avsc"), ["event_id", "amount"], task)
    assert compile_writer(schema) is not None
    encoder = AvroEncoder(LocalCatalogue(), schema, f"answers-{task}-value")
    answer = {
        "event_id": "e-1", "amount": 12.5, "input_topic": "in", "input_partition": 2,
        "input_offset": 40, "event_timestamp_ms": 1_700_000_000_000, "model_name": "m",
        "model_version": "3", "score": 0.25, "label": "fraud" if task == "multiclass" else True,
        "top_classes": [{"label": "fraud", "probability": 0.75}], "value": 1.5, "status": "OK",
        "reason": None, "degraded_by": None, "missing_features": ["user_stats"],
        "timings": {"batch_size": 3, "decode_us": 10, "features_us": 20, "inference_us": 30},
    }  # fmt: skip
    record = {f["name"]: answer[f["name"]] for f in schema["fields"]}
    assert encoder.encode(record) == encoder._encode_with_fastavro(record)


@pytest.mark.parametrize(
    "change",
    [
        {"ratio": np.float32(0.5)},  # numpy scalars: fastavro converts them
        {"small": np.int64(7)},
        {"flag": np.bool_(True)},
        {"ratio": 1e300},  # beyond float32: fastavro's cast
        {"tags": ("a", "b")},  # a tuple for an array
        {"maybe_text": None, "text": "\ud800x"},  # a lone surrogate: fastavro's error
    ],
)
def test_values_it_was_not_built_for_are_left_to_fastavro(change):
    encoder = AvroEncoder(LocalCatalogue(), RICH, "rich-value")
    record = {**EXAMPLE, **change}
    try:
        expected = encoder._encode_with_fastavro(record)
    except Exception as exc:  # fastavro refuses: so must the encoder, the same way
        with pytest.raises(type(exc)):
            encoder.encode(record)
        return
    assert encoder.encode(record) == expected


WITH_DEFAULTS = {
    "type": "record",
    "name": "Defaults",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "priority", "type": ["null", "int"], "default": None},
        {"name": "maybe", "type": ["null", "string"]},  # no default: fastavro writes null
        {"name": "retries", "type": "int", "default": 3},
        {"name": "source", "type": "string", "default": "web"},
        {"name": "tags", "type": {"type": "array", "items": "string"}, "default": ["a"]},
        {"name": "inner", "type": {"type": "record", "name": "Inner", "fields": [
            {"name": "weight", "type": "float", "default": 1}]}, "default": {}},
        {"name": "blob", "type": "bytes", "default": "\u00ff"},  # fastavro refuses it
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    "absent",
    [["priority"], ["maybe"], ["retries", "source"], ["tags"], ["inner"], ["priority", "blob"]],
)
def test_absent_fields_get_the_default_fastavro_writes(absent, monkeypatch):
    encoder = AvroEncoder(LocalCatalogue(), WITH_DEFAULTS, "defaults-value")
    record = {"id": "e-1", "priority": 2, "maybe": "x", "retries": 1, "source": "app",
              "tags": [], "inner": {"weight": 0.5}, "blob": b"\x00"}  # fmt: skip
    partial = {k: v for k, v in record.items() if k not in absent}
    if "blob" in absent:  # fastavro refuses its own reading of that default: so must we
        with pytest.raises(TypeError):
            encoder._encode_with_fastavro(partial)
        with pytest.raises(TypeError):
            encoder.encode(partial)
        return
    expected = encoder._encode_with_fastavro(partial)
    monkeypatch.setattr(encoder, "_encode_with_fastavro", None)  # the compiled path writes it
    assert encoder.encode(partial) == expected


def test_an_absent_field_without_a_default_gets_fastavros_error():
    encoder = AvroEncoder(LocalCatalogue(), RICH, "rich-value")
    without_required = {k: v for k, v in EXAMPLE.items() if k != "text"}
    with pytest.raises(ValueError, match="no value and no default for text"):
        encoder.encode(without_required)


def test_a_wrong_type_raises_fastavros_error():
    encoder = AvroEncoder(LocalCatalogue(), RICH, "rich-value")
    with pytest.raises(TypeError):
        fastavro_bytes(RICH, {**EXAMPLE, "text": 5})
    with pytest.raises(TypeError):
        encoder.encode({**EXAMPLE, "text": 5})


@pytest.mark.parametrize(
    "field_type",
    [
        {"type": "long", "logicalType": "timestamp-millis"},
        {"type": "fixed", "name": "Id", "size": 4},
        ["null", "string", "long"],
        "Later",  # a name defined further on
    ],
)
def test_schemas_with_other_types_are_not_compiled(field_type):
    schema = {"type": "record", "name": "R", "fields": [{"name": "x", "type": field_type}]}
    assert compile_writer(schema) is None


def test_nan_and_infinities_are_written_as_fastavro_writes_them():
    for value in (math.nan, math.inf, -math.inf, -0.0):
        record = {**EXAMPLE, "ratio": value, "precise": value}
        assert compiled_bytes(RICH, record) == fastavro_bytes(RICH, record)


EXAMPLE = {
    "flag": True, "small": -3, "big": 2**40, "ratio": 0.25, "precise": -1.5, "text": "héllo",
    "blob": b"\x00\x01", "nothing": None, "maybe_text": "x", "text_or_null": None,
    "colour": "GREEN", "tags": ["a"], "counts": {"k": -1}, "inner": {"label": "l", "weight": 1.0},
    "inners": [], "maybe_inner": {"label": "m", "weight": 2.0}, "second_colour": "RED",
}  # fmt: skip


def test_strings_kept_encoded_stay_bounded_and_right():
    strings = _Strings()
    for i in range(3 * _MAX_KNOWN_STRINGS):
        out = bytearray()
        strings.write(out, f"id-{i}")
        assert len(strings._known) <= _MAX_KNOWN_STRINGS
    out = bytearray()
    strings.write(out, "OK")
    strings.write(out, "OK")  # the second from what was kept
    assert bytes(out) == b"\x04OK\x04OK"


@pytest.mark.parametrize(
    "change",
    [
        {"ratio": 2**200},  # an int beyond float32 and beyond a double
        {"precise": 10**400},
        {"ratio": 2**128 - 2**103},
        {"maybe_inner": {"label": "m", "weight": 2.0, "-type": "test.rich.Other"}},
    ],
)
def test_numbers_beyond_a_float_and_named_values_are_fastavros_too(change):
    encoder = AvroEncoder(LocalCatalogue(), RICH, "rich-value")
    record = {**EXAMPLE, **change}
    try:
        expected = encoder._encode_with_fastavro(record)
    except Exception as exc:
        with pytest.raises(type(exc)):
            encoder.encode(record)
        return
    assert encoder.encode(record) == expected


def test_types_named_like_avro_keywords_and_top_level_unions_are_not_compiled():
    named_map = {"type": "enum", "name": "map", "symbols": ["A"]}
    schema = {"type": "record", "name": "R", "fields": [{"name": "e", "type": named_map}]}
    assert compile_writer(schema) is None
    assert compile_writer(["null", "string"]) is None
