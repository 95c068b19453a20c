"""The click-intent artifact as skl2onnx writes it: one input per column, ZipMap
outputs that agree with the scikit-learn pipeline, no headrace metadata, and the
defaults a config reads equal to the medians it was trained with."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from features.sample_data import INTENT_CLASSES, SampleWorld
from models.train_intent import (
    INPUT_NAMES,
    INTENT_DEFAULTS,
    STORE_FEATURES,
    fit_intent,
    intent_path,
    train_intent,
    training_medians,
)

WORLD = SampleWorld()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = tmp_path_factory.mktemp("intent") / "click-intent.onnx"
    report = train_intent(path, WORLD)
    return path, report


@pytest.fixture(scope="module")
def fit():
    """The pipeline `train_intent` exported: training is deterministic."""
    return fit_intent(WORLD)


@pytest.fixture(scope="module")
def session(trained):
    return ort.InferenceSession(str(trained[0]), providers=["CPUExecutionProvider"])


def feeds_of(rows) -> dict[str, np.ndarray]:
    return {name: rows[name].to_numpy().reshape(-1, 1) for name in INPUT_NAMES}


def test_inputs_are_one_column_each_with_its_own_type(session):
    expected = {"page_type": "tensor(string)", "dwell_ms": "tensor(int64)"}
    expected.update(dict.fromkeys(STORE_FEATURES, "tensor(float)"))
    assert {port.name: port.type for port in session.get_inputs()} == expected
    assert all(port.shape == [None, 1] for port in session.get_inputs())
    outputs = {port.name: port.type for port in session.get_outputs()}
    assert outputs == {
        "output_label": "tensor(string)",
        "output_probability": "seq(map(string,tensor(float)))",
    }


def test_the_artifact_carries_no_headrace_metadata(trained):
    assert list(onnx.load(str(trained[0])).metadata_props) == []


def test_onnx_answers_equal_the_pipeline_on_held_out_rows(session, fit):
    labels, maps = session.run(["output_label", "output_probability"], feeds_of(fit.held_out))
    expected = fit.pipeline.predict_proba(fit.held_out)
    classes = list(fit.pipeline.classes_)
    assert sorted(classes) == sorted(INTENT_CLASSES)
    assert all(set(m) == set(classes) for m in maps)
    served = np.array([[m[c] for c in classes] for m in maps])
    np.testing.assert_allclose(served, expected, atol=1e-4)
    np.testing.assert_array_equal(labels, fit.pipeline.predict(fit.held_out))


def test_unknown_page_types_are_ignored_not_refused(session, fit):
    rows = fit.held_out.iloc[:2].copy()
    rows["page_type"] = ["wishlist", "home"]
    labels, maps = session.run(None, feeds_of(rows))
    assert len(labels) == 2
    assert sum(maps[0].values()) == pytest.approx(1.0, abs=1e-5)


def test_the_model_learned_the_ground_truth(trained, fit):
    report = trained[1]
    majority = max(np.mean(fit.held_out_labels == c) for c in INTENT_CLASSES)
    assert report["accuracy"] > majority + 0.1
    assert report["accuracy"] > report["truth_accuracy"] - 0.05
    assert report["log_loss"] < report["truth_log_loss"] + 0.1


def test_the_config_defaults_are_the_training_medians(trained):
    assert trained[1]["defaults"] == INTENT_DEFAULTS
    assert training_medians(WORLD) == INTENT_DEFAULTS


def test_the_sample_assets_hold_the_intent_model_beside_the_fraud_one(sample_assets):
    path = intent_path(sample_assets.model)
    assert path.parent == sample_assets.model.parent
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [port.name for port in session.get_inputs()] == list(INPUT_NAMES)
