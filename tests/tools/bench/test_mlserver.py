"""The MLServer baseline's pure parts: V2 requests and answers, the model matrix of a
batched request, and which of Feast's requirements its environment installs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools.bench.mlserver import v2
from tools.bench.mlserver.env import feast_requirements

EVENT = {
    "event_id": "e-1",
    "user_id": "u-7",
    "merchant_id": "m-3",
    "amount": 12.5,
    "hour_of_day": 23,
    "is_online": True,
    "event_time_ms": 1_700_000_000_000,
    "priority": None,
}


def test_a_request_has_one_batched_input_per_field_with_a_value():
    key, value, headers = v2.record(b"u-7", EVENT)
    document = json.loads(value)
    inputs = {i["name"]: i for i in document["inputs"]}
    assert key == b"u-7"
    assert headers == [("mlserver-model", b"fraud")]
    assert "priority" not in inputs  # null: left out
    assert [(i["datatype"], i["shape"], i["data"]) for i in inputs.values()] == [
        ("BYTES", [1], ["e-1"]),
        ("BYTES", [1], ["u-7"]),
        ("BYTES", [1], ["m-3"]),
        ("FP64", [1], [12.5]),
        ("INT64", [1], [23]),
        ("BOOL", [1], [True]),  # a bool is not taken for an int
        ("INT64", [1], [1_700_000_000_000]),
    ]


def test_a_field_of_another_type_is_refused_with_what_arrived():
    with pytest.raises(v2.V2Error, match="got list"):
        v2.request({"tags": ["a"]})


def test_the_kafka_timestamp_is_added_as_one_more_input_without_touching_the_request():
    request = json.loads(v2.request(EVENT))
    stamped = v2.with_kafka_timestamp(request, 1234)
    assert stamped["inputs"][-1] == {
        "name": v2.TIMESTAMP_INPUT, "datatype": "INT64", "shape": [1], "data": [1234],
    }  # fmt: skip
    assert stamped["inputs"][:-1] == request["inputs"]
    assert len(request["inputs"]) == len(stamped["inputs"]) - 1


def test_a_batch_gives_entity_rows_and_a_matrix_with_defaults_for_missing_features():
    # What MLServer's adaptive batching hands the runtime: inputs merged along the batch.
    inputs = {"user_id": ["u-1", "u-2"], "merchant_id": ["m-1", "m-9"],
              "amount": [3.0, 4.0], "is_online": [True, False]}  # fmt: skip
    rows = v2.entity_rows(inputs, {"user_id": "user_id", "merchant_id": "merchant_id"})
    assert rows == [{"user_id": "u-1", "merchant_id": "m-1"},
                    {"user_id": "u-2", "merchant_id": "m-9"}]  # fmt: skip
    features = {"user_stats__txn_count_7d": [5, None], "merchant_stats__risk_score": [None, 0.5]}
    columns = [("amount", 0.0), ("is_online", 0.0), ("user_stats__txn_count_7d", 7.0),
               ("merchant_stats__risk_score", 0.1)]  # fmt: skip
    matrix = v2.model_matrix(inputs, features, columns, rows=2)
    assert matrix.dtype == np.float32
    np.testing.assert_allclose(matrix, [[3.0, 1.0, 5.0, 0.1], [4.0, 0.0, 7.0, 0.5]])


def test_a_column_without_a_source_or_of_the_wrong_length_is_an_error():
    with pytest.raises(v2.V2Error, match="neither an input"):
        v2.model_matrix({"amount": [1.0]}, {}, [("missing", 0.0)], rows=1)
    with pytest.raises(v2.V2Error, match="2 values for 1 rows"):
        v2.model_matrix({"amount": [1.0, 2.0]}, {}, [("amount", 0.0)], rows=1)


def test_the_score_is_the_positive_class_column_or_the_only_one():
    assert v2.positive_scores(np.array([[0.75, 0.25], [0.5, 0.5]])) == [0.25, 0.5]
    assert v2.positive_scores(np.array([[0.125], [0.5]])) == [0.125, 0.5]


def test_an_answer_is_read_back_with_its_input_timestamp():
    response = {
        "model_name": "fraud",
        "id": "u-7",
        "outputs": [
            {"name": "score", "shape": [1], "datatype": "FP32", "data": [0.25]},
            {"name": "label", "shape": [1], "datatype": "BOOL", "data": [False]},
            {"name": "event_timestamp_ms", "shape": [1], "datatype": "INT64", "data": [42]},
        ],
    }
    assert v2.read_answer(json.dumps(response).encode()) == v2.Answer(42, 0.25, False)


@pytest.mark.parametrize(
    "value",
    [
        b"not json",
        b'{"outputs": []}',
        b'{"error": "boom"}',
        b'{"outputs": [{"name": "score", "data": []}]}',
    ],
)
def test_anything_else_is_not_an_answer(value):
    with pytest.raises(v2.V2Error, match="expected a V2 response"):
        v2.read_answer(value)


def test_the_environment_takes_feast_requirements_but_its_web_server_pins_and_extras():
    requires = [
        "click<9.0.0,>=7.0.0",
        "starlette>=1.0.1",
        "fastapi>=0.68.0",
        "uvicorn[standard]>=0.30.6",
        "protobuf>=4.24.0",
        'redis>=4.2.2; extra == "redis"',
        'gunicorn; platform_system != "Windows"',
    ]
    assert feast_requirements(requires) == [
        "click<9.0.0,>=7.0.0",
        "uvicorn[standard]>=0.30.6",
        "protobuf>=4.24.0",
        'gunicorn; platform_system != "Windows"',
    ]
