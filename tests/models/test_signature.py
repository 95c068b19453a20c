"""The model's signature, resolved from hand-made graph ports (no ONNX needed): what the
config or the headrace metadata says, every mismatch with the graph, where columns come
from, and the answers read from each kind of output."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from models.config import ModelConfig
from models.errors import ModelError
from models.signature import Column, GraphPort, ModelOutput, Signature, TensorInput, resolve

# The sample fraud model as ONNX Runtime reports it, with its headrace metadata.
FRAUD_INPUTS = [GraphPort("X", "tensor(float)", (None, 3))]
FRAUD_OUTPUTS = [
    GraphPort("label", "tensor(int64)", (None,)),
    GraphPort("probabilities", "tensor(float)", (None, 2)),
]
METADATA = {
    "model_name": "fraud-mlp",
    "model_version": "7",
    "feature_names": json.dumps(["amount", "hour_of_day", "user_stats__txn_count_7d"]),
    "feature_defaults": json.dumps([0.0, 0.0, 4.5]),
    "threshold": "0.3",
}

# A plain skl2onnx classifier: one input per column, ZipMap probabilities, no metadata.
PLAIN_INPUTS = [
    GraphPort("colour", "tensor(string)", (None, 1)),
    GraphPort("size", "tensor(int64)", (None, 1)),
]
PLAIN_OUTPUTS = [
    GraphPort("output_label", "tensor(string)", (None,)),
    GraphPort("output_probability", "seq(map(string,tensor(float)))", ()),
]
PLAIN_INPUTS_CONFIG = [
    {"name": "colour", "dtype": "string", "columns": ["colour"]},
    {"name": "size", "dtype": "int64", "columns": [{"from": "size", "default": 2}]},
]


def config(**fields) -> ModelConfig:
    return ModelConfig(path="artifacts/model.onnx", **fields)


def problems_of(excinfo: pytest.ExceptionInfo) -> list[str]:
    """The listed problems of a resolve error, one per line after the first."""
    return [line.strip() for line in str(excinfo.value).splitlines()[1:]]


# --- resolved from the headrace metadata or the config ---------------------------------


def test_headrace_metadata_gives_columns_defaults_name_and_threshold():
    signature = resolve(config(), FRAUD_INPUTS, FRAUD_OUTPUTS, METADATA)
    assert (signature.name, signature.version) == ("fraud-mlp", "7")
    (tensor,) = signature.inputs
    assert (tensor.name, tensor.dtype) == ("X", "float32")
    assert tensor.columns == (
        Column("amount", 0.0),
        Column("hour_of_day", 0.0),
        Column("user_stats__txn_count_7d", 4.5),
    )
    output = signature.output
    assert (output.task, output.tensor, output.zipmap) == ("binary", "probabilities", False)
    assert output.threshold == pytest.approx(0.3)
    assert signature.sources == ["amount", "hour_of_day", "user_stats__txn_count_7d"]


def test_the_config_overrides_the_metadata_name_version_and_output():
    signature = resolve(
        config(name="fraud", version="9", output={"task": "binary", "threshold": 0.8}),
        FRAUD_INPUTS,
        FRAUD_OUTPUTS,
        METADATA,
    )
    assert (signature.name, signature.version) == ("fraud", "9")
    assert signature.output.threshold == pytest.approx(0.8)


def test_a_configured_model_defaults_by_dtype_and_is_named_after_its_file():
    signature = resolve(
        config(inputs=PLAIN_INPUTS_CONFIG, output={"task": "multiclass", "top_k": 2}),
        PLAIN_INPUTS,
        PLAIN_OUTPUTS,
        {},
    )
    assert (signature.name, signature.version) == ("model", "1")
    assert [(t.name, t.dtype, t.columns) for t in signature.inputs] == [
        ("colour", "string", (Column("colour", ""),)),
        ("size", "int64", (Column("size", 2),)),
    ]
    output = signature.output
    assert (output.task, output.tensor, output.zipmap) == ("multiclass", "output_probability", True)
    assert output.classes is None  # a ZipMap tells its classes at warm-up
    assert output.top_k == 2


def test_regression_reads_the_first_output_by_default():
    outputs = [GraphPort("variable", "tensor(float)", (None, 1)), FRAUD_OUTPUTS[0]]
    signature = resolve(
        config(inputs=[{"name": "X", "columns": ["a", "b", "c"]}], output={"task": "regression"}),
        FRAUD_INPUTS,
        outputs,
        {},
    )
    assert signature.output.tensor == "variable"


# --- every mismatch, named, with what the model has ------------------------------------


def test_an_input_the_model_does_not_have_lists_the_models_inputs():
    inputs = [*PLAIN_INPUTS_CONFIG, {"name": "weight", "columns": ["weight"]}]
    with pytest.raises(ModelError) as excinfo:
        resolve(
            config(inputs=inputs, output={"task": "multiclass"}), PLAIN_INPUTS, PLAIN_OUTPUTS, {}
        )
    assert problems_of(excinfo) == [
        "input 'weight' is not an input of the model "
        "(inputs: colour tensor(string) [None, 1], size tensor(int64) [None, 1])"
    ]
    assert "model.onnx does not fit its config" in str(excinfo.value)


def test_a_model_input_with_no_source():
    with pytest.raises(ModelError) as excinfo:
        resolve(
            config(inputs=PLAIN_INPUTS_CONFIG[:1], output={"task": "multiclass"}),
            PLAIN_INPUTS,
            PLAIN_OUTPUTS,
            {},
        )
    assert problems_of(excinfo) == [
        "model input 'size' (tensor(int64)) has no source: add it to model.inputs"
    ]


@pytest.mark.parametrize(
    ("configured", "model_type", "hint"),
    [
        ("float32", "tensor(string)", "string"),
        ("int64", "tensor(float)", "float32"),
        ("string", "tensor(int64)", "int64"),
        ("float32", "tensor(double)", "a supported type"),
    ],
)
def test_a_dtype_that_does_not_fit_names_the_input_and_the_right_dtype(
    configured, model_type, hint
):
    graph = [GraphPort("colour", model_type, (None, 1))]
    default = {"float32": 0.0, "int64": 0, "string": ""}[configured]
    inputs = [
        {"name": "colour", "dtype": configured, "columns": [{"from": "c", "default": default}]}
    ]
    with pytest.raises(ModelError) as excinfo:
        resolve(config(inputs=inputs, output={"task": "multiclass"}), graph, PLAIN_OUTPUTS, {})
    (problem,) = problems_of(excinfo)
    assert problem.startswith(f"input 'colour' is {model_type} in the model")
    assert f"config says dtype {configured}" in problem
    assert problem.endswith(f"hint: set dtype to {hint}")


def test_a_width_mismatch():
    with pytest.raises(ModelError) as excinfo:
        resolve(
            config(inputs=[{"name": "X", "columns": ["amount", "hour_of_day"]}]),
            FRAUD_INPUTS,
            FRAUD_OUTPUTS,
            METADATA,
        )
    assert problems_of(excinfo) == [
        "input 'X' takes 3 columns, the config gives 2 (['amount', 'hour_of_day'])"
    ]


def test_a_symbolic_width_is_not_checked_but_a_rank_is():
    symbolic = [GraphPort("X", "tensor(float)", ("batch", "features"))]
    inputs = [{"name": "X", "columns": ["a", "b"]}]
    resolve(config(inputs=inputs), symbolic, FRAUD_OUTPUTS, METADATA)
    flat = [GraphPort("X", "tensor(float)", (None,))]
    with pytest.raises(ModelError, match=r"input 'X' has shape \[None\]: expected 2-D"):
        resolve(config(inputs=inputs), flat, FRAUD_OUTPUTS, METADATA)


def test_an_output_tensor_that_is_not_an_output_lists_the_outputs():
    with pytest.raises(ModelError) as excinfo:
        resolve(
            config(output={"task": "binary", "tensor": "probability"}),
            FRAUD_INPUTS,
            FRAUD_OUTPUTS,
            METADATA,
        )
    assert problems_of(excinfo) == [
        "output.tensor 'probability' is not an output of the model "
        "(outputs: label tensor(int64) [None], probabilities tensor(float) [None, 2])"
    ]


def test_no_metadata_and_no_inputs_says_to_set_model_inputs_and_lists_them():
    with pytest.raises(ModelError) as excinfo:
        resolve(config(output={"task": "multiclass"}), PLAIN_INPUTS, PLAIN_OUTPUTS, {})
    message = str(excinfo.value)
    assert "carries no headrace metadata" in message
    assert "set model.inputs" in message
    assert "colour tensor(string) [None, 1], size tensor(int64) [None, 1]" in message
    assert "output_probability seq(map(string,tensor(float))) []" in message


def test_no_metadata_and_no_output_says_to_set_model_output():
    with pytest.raises(ModelError, match=r"set model\.output .*output_probability"):
        resolve(config(inputs=PLAIN_INPUTS_CONFIG), PLAIN_INPUTS, PLAIN_OUTPUTS, {})


def test_malformed_metadata_is_a_clear_error():
    metadata = {**METADATA, "feature_defaults": "[0.0, "}
    with pytest.raises(ModelError, match="malformed headrace metadata"):
        resolve(config(), FRAUD_INPUTS, FRAUD_OUTPUTS, metadata)


@pytest.mark.parametrize("default", ["high", True])
def test_a_default_that_is_not_a_number_for_a_float32_column(default):
    inputs = [{"name": "X", "columns": ["a", {"from": "b", "default": default}, "c"]}]
    with pytest.raises(ModelError) as excinfo:
        resolve(config(inputs=inputs), FRAUD_INPUTS, FRAUD_OUTPUTS, METADATA)
    assert problems_of(excinfo) == [f"input 'X' column 'b': default {default!r} is not a float32"]


def test_regression_cannot_read_a_zipmap():
    with pytest.raises(ModelError) as excinfo:
        resolve(
            config(
                inputs=PLAIN_INPUTS_CONFIG,
                output={"task": "regression", "tensor": "output_probability"},
            ),
            PLAIN_INPUTS,
            PLAIN_OUTPUTS,
            {},
        )
    assert problems_of(excinfo) == [
        "output 'output_probability' is seq(map(string,tensor(float))): regression reads a tensor"
    ]


def test_a_classifier_cannot_read_labels():
    with pytest.raises(ModelError, match=r"output 'output_label' is tensor\(string\): a multi"):
        resolve(
            config(
                inputs=PLAIN_INPUTS_CONFIG,
                output={"task": "multiclass", "tensor": "output_label"},
            ),
            PLAIN_INPUTS,
            PLAIN_OUTPUTS,
            {},
        )


def test_a_positive_class_needs_classes_that_hold_it_for_a_tensor_output():
    with pytest.raises(ModelError, match=r"positive_class needs output\.classes"):
        resolve(
            config(output={"task": "binary", "positive_class": "fraud"}),
            FRAUD_INPUTS,
            FRAUD_OUTPUTS,
            METADATA,
        )
    with pytest.raises(ModelError, match=r"'fraud' is not in output\.classes \['no', 'yes'\]"):
        resolve(
            config(output={"task": "binary", "positive_class": "fraud", "classes": ["no", "yes"]}),
            FRAUD_INPUTS,
            FRAUD_OUTPUTS,
            METADATA,
        )


def test_every_problem_is_listed_in_one_error():
    inputs = [
        {"name": "colour", "dtype": "float32", "columns": ["colour", "shade"]},
        {"name": "weight", "columns": [{"from": "weight", "default": "heavy"}]},
    ]
    with pytest.raises(ModelError) as excinfo:
        resolve(
            config(inputs=inputs, output={"task": "multiclass", "tensor": "probabilities"}),
            PLAIN_INPUTS,
            PLAIN_OUTPUTS,
            {},
        )
    problems = problems_of(excinfo)
    expected = [
        r"input 'colour' is tensor\(string\) in the model.*set dtype to string",
        r"input 'colour' takes 1 columns, the config gives 2",
        r"input 'weight' is not an input of the model",
        r"model input 'size' \(tensor\(int64\)\) has no source",
        r"input 'weight' column 'weight': default 'heavy' is not a float32",
        r"output\.tensor 'probabilities' is not an output of the model",
    ]
    assert len(problems) == len(expected)
    for pattern in expected:
        assert any(re.search(pattern, p) for p in problems), (pattern, problems)


# --- where the columns come from -------------------------------------------------------


def signature_with(*inputs: TensorInput) -> Signature:
    return Signature("m", "1", inputs, binary())


def test_every_column_from_an_event_field_or_a_feature_has_no_problem():
    signature = signature_with(
        TensorInput("X", "float32", (Column("amount", 0.0), Column("user__age", 0.0))),
        TensorInput("page", "string", (Column("page_type", ""),)),
    )
    assert signature.source_problems(["amount", "page_type"], ["user__age"]) == []


def test_a_column_that_is_neither_an_event_field_nor_a_feature():
    columns = (Column("amount", 0.0), Column("user__agee", 0.0))
    signature = signature_with(TensorInput("X", "float32", columns))
    assert signature.source_problems(["amount"], ["user__age"]) == [
        "model m: input 'X' column 'user__agee' is neither a field of the event (['amount']) "
        "nor a feature of the pipeline's feature service (['user__age']); "
        "hint: did you mean 'user__age'?"
    ]


@pytest.mark.parametrize("dtype", ["string", "bool"])
def test_a_string_or_bool_column_cannot_come_from_a_store_feature(dtype):
    signature = signature_with(TensorInput("kind", dtype, (Column("product__kind", ""),)))
    (problem,) = signature.source_problems(["page_type"], ["product__kind"])
    assert problem.startswith("model m: input 'kind' column 'product__kind' is a store feature")
    assert f"a {dtype} column must come from an event field" in problem


# --- answers by task -------------------------------------------------------------------


def binary(**changes) -> ModelOutput:
    fields = {
        "task": "binary",
        "tensor": "probabilities",
        "zipmap": False,
        "classes": None,
        "positive_class": None,
        "threshold": 0.5,
        "top_k": 3,
    }
    return ModelOutput(**{**fields, **changes})


def multiclass(**changes) -> ModelOutput:
    return binary(**{"task": "multiclass", "top_k": 2, **changes})


def test_binary_scores_the_second_column_against_the_threshold():
    probabilities = np.array([[0.75, 0.25], [0.5, 0.5], [0.25, 0.75]], dtype=np.float32)
    answers = binary().answers(probabilities, 3)
    assert answers == [
        {"score": 0.25, "label": False},
        {"score": 0.5, "label": True},  # reaching the threshold counts
        {"score": 0.75, "label": True},
    ]
    strict = binary(threshold=0.625).answers(probabilities, 3)
    assert [a["label"] for a in strict] == [False, False, True]


def test_binary_scores_the_positive_class_column():
    output = binary(classes=("fraud", "ok"), positive_class="fraud")
    probabilities = np.array([[0.75, 0.25], [0.25, 0.75]], dtype=np.float32)
    assert output.answers(probabilities, 2) == [
        {"score": 0.75, "label": True},
        {"score": 0.25, "label": False},
    ]


def test_binary_reads_a_single_probability_column():
    assert binary().answers(np.array([[0.125], [0.875]], dtype=np.float32), 2) == [
        {"score": 0.125, "label": False},
        {"score": 0.875, "label": True},
    ]


def test_binary_from_a_zipmap_uses_its_classes():
    output = binary(tensor="output_probability", zipmap=True).learn_classes(
        [{"no": 0.5, "yes": 0.5}]
    )
    assert output.classes == ("no", "yes")
    rows = [{"no": 0.875, "yes": 0.125}, {"no": 0.25, "yes": 0.75}]
    assert output.answers(rows, 2) == [
        {"score": 0.125, "label": False},
        {"score": 0.75, "label": True},
    ]
    by_no = binary(zipmap=True, positive_class="no").learn_classes(rows)
    assert [a["score"] for a in by_no.answers(rows, 2)] == [0.875, 0.25]


def test_multiclass_from_a_tensor_lists_the_top_k_in_order():
    output = multiclass(classes=("cat", "dog", "eel"))
    probabilities = np.array([[0.25, 0.125, 0.625], [0.5, 0.25, 0.25]], dtype=np.float32)
    assert output.answers(probabilities, 2) == [
        {
            "label": "eel",
            "score": 0.625,
            "top_classes": [
                {"label": "eel", "probability": 0.625},
                {"label": "cat", "probability": 0.25},
            ],
        },
        {
            "label": "cat",
            "score": 0.5,
            # A tie keeps the classes' order.
            "top_classes": [
                {"label": "cat", "probability": 0.5},
                {"label": "dog", "probability": 0.25},
            ],
        },
    ]


def test_multiclass_without_classes_labels_columns_by_number():
    (answer,) = multiclass(top_k=5).answers(np.array([[0.125, 0.875]], dtype=np.float32), 1)
    assert answer["label"] == "1"
    assert [c["label"] for c in answer["top_classes"]] == ["1", "0"]  # top_k capped at 2


def test_multiclass_from_a_zipmap_learns_labels_from_its_keys():
    rows = [
        {"blue": 0.125, "green": 0.25, "red": 0.625},
        {"blue": 0.5, "green": 0.375, "red": 0.125},
    ]
    output = multiclass(tensor="output_probability", zipmap=True).learn_classes(rows)
    assert output.classes == ("blue", "green", "red")
    answers = output.answers(rows, 2)
    assert [a["label"] for a in answers] == ["red", "blue"]
    assert [a["score"] for a in answers] == [0.625, 0.5]
    assert answers[1]["top_classes"] == [
        {"label": "blue", "probability": 0.5},
        {"label": "green", "probability": 0.375},
    ]


def test_configured_classes_order_a_zipmap():
    rows = [{"blue": 0.125, "green": 0.25, "red": 0.625}]
    output = multiclass(zipmap=True, classes=("red", "green", "blue")).learn_classes(rows)
    assert output.classes == ("red", "green", "blue")
    assert output.answers(rows, 1)[0]["label"] == "red"


def test_a_zipmap_that_disagrees_with_the_config_is_refused():
    rows = [{"blue": 0.5, "red": 0.5}]
    with pytest.raises(ModelError, match=r"output\.classes \['blue', 'green'\] differ"):
        multiclass(zipmap=True, classes=("blue", "green")).learn_classes(rows)
    with pytest.raises(ModelError, match=r"positive_class 'green' is not a class"):
        binary(zipmap=True, positive_class="green").learn_classes(rows)


def test_a_zipmap_with_integer_keys():
    # A classifier trained on integer labels: its ZipMap is keyed by int64.
    rows = [{0: 0.25, 1: 0.75}, {0: 0.875, 1: 0.125}]
    output = multiclass(zipmap=True).learn_classes(rows)
    assert output.classes == ("0", "1")
    assert [a["label"] for a in output.answers(rows, 2)] == ["1", "0"]


def test_regression_answers_one_value_per_row():
    output = binary(task="regression", tensor="variable")
    values = np.array([[1.5], [-2.25]], dtype=np.float32)
    assert output.answers(values, 2) == [{"value": 1.5}, {"value": -2.25}]
    assert output.answers(np.array([3.0, 4.0]), 2) == [{"value": 3.0}, {"value": 4.0}]


def test_a_row_count_that_does_not_match_is_an_error():
    with pytest.raises(ModelError, match="model returned 3 rows for 2"):
        binary().answers(np.zeros((3, 2), dtype=np.float32), 2)


def test_unanswered_by_task():
    answer = binary().unanswered()
    assert answer["label"] is False and math.isnan(answer["score"])
    answer = multiclass().unanswered()
    assert answer["label"] is None and answer["top_classes"] == [] and math.isnan(answer["score"])
    answer = binary(task="regression").unanswered()
    assert list(answer) == ["value"] and math.isnan(answer["value"])


def test_fixed_answers():
    assert binary(threshold=0.25).fixed(0.25) == {"score": 0.25, "label": True}
    assert binary(task="regression").fixed(1.5) == {"value": 1.5}


def test_classes_that_do_not_match_a_probability_tensor_are_refused():
    with pytest.raises(ModelError, match="names 3 classes, the output"):
        multiclass(classes=("a", "b", "c")).learn_classes(np.zeros((1, 2), np.float32))


def test_a_multiclass_row_with_a_class_that_is_not_a_number_has_no_score():
    # Beyond the top k too: the row's best class is unknown, so the answer is not OK.
    output = multiclass(classes=("cat", "dog", "eel"))
    probabilities = np.array([[0.25, 0.625, math.nan], [0.5, 0.25, 0.25]], dtype=np.float32)
    broken, fine = output.answers(probabilities, 2)
    assert math.isnan(broken["score"]) and fine["score"] == 0.5
