"""The ONNX model artifact and session: the resolved signature, providers, shapes,
concurrency; and a plain skl2onnx model described by the config alone."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest

from models.config import ModelConfig
from models.errors import ModelError
from models.session import ModelSession
from models.train import FEATURE_NAMES, MODEL_NAME


@pytest.fixture(scope="module")
def session(sample_assets):
    model = ModelSession(ModelConfig(path=sample_assets.model), warmup_batch_sizes=(1, 64))
    yield model
    model.close()


def feeds(matrix: np.ndarray) -> dict[str, np.ndarray]:
    return {"X": matrix.astype(np.float32)}


def test_the_signature_comes_from_the_artifacts_metadata(session):
    signature = session.signature
    assert signature.name == MODEL_NAME
    assert signature.version == "1"
    (tensor,) = signature.inputs
    assert (tensor.name, tensor.dtype) == ("X", "float32")
    assert tuple(c.source for c in tensor.columns) == FEATURE_NAMES
    assert all(isinstance(c.default, float) for c in tensor.columns)
    output = signature.output
    assert (output.task, output.tensor) == ("binary", "probabilities")
    assert 0 < output.threshold < 1
    assert set(session.warmup_seconds) == {1, 64}


def test_scores_are_probabilities_one_per_row(session):
    rng = np.random.default_rng(0)
    matrix = rng.random((37, len(FEATURE_NAMES)), dtype=np.float32) * 100
    answers = session.run(feeds(matrix))
    assert len(answers) == 37
    threshold = session.signature.output.threshold
    for answer in answers:
        assert set(answer) == {"score", "label"}
        assert 0 <= answer["score"] <= 1
        assert answer["label"] == (answer["score"] >= threshold)


def test_riskier_inputs_score_higher(session):
    """The sample model learned the synthetic ground truth, not noise."""
    (tensor,) = session.signature.inputs
    base = np.array([c.default for c in tensor.columns], dtype=np.float32)
    base[0] = 30.0  # amount near the usual spend
    risky = base.copy()
    risky[0] = 3000.0
    risky[FEATURE_NAMES.index("user_stats__chargeback_rate_90d")] = 0.2
    risky[FEATURE_NAMES.index("merchant_stats__risk_score")] = 0.6
    safe_answer, risky_answer = session.run(feeds(np.stack([base, risky])))
    assert risky_answer["score"] > safe_answer["score"] + 0.2


def test_zero_feeds_fit_the_signature(session):
    zeros = session.zero_feeds(3)
    assert list(zeros) == ["X"]
    assert zeros["X"].shape == (3, len(FEATURE_NAMES)) and zeros["X"].dtype == np.float32
    assert len(session.run(zeros)) == 3


def test_a_wrong_shape_is_a_model_error(session):
    with pytest.raises(ModelError, match=f"{MODEL_NAME} failed on a batch of 2") as excinfo:
        session.run(feeds(np.zeros((2, 3))))
    assert excinfo.value.__cause__ is not None  # ONNX Runtime's own error, wrapped


async def test_async_answers_match_serial_ones(session):
    rng = np.random.default_rng(1)
    batches = [feeds(rng.random((16, len(FEATURE_NAMES)), dtype=np.float32)) for _ in range(8)]
    together = await asyncio.gather(*(session.run_timed(b) for b in batches))
    for batch, (answers, seconds) in zip(batches, together, strict=True):
        assert answers == session.run(batch)
        assert seconds > 0


def cuda_session(model_path) -> ModelSession:
    """A session that asked for CUDA: what it really got decides which tests apply
    (a machine can have `nvidia-smi` and still no usable CUDA, or the other way)."""
    return ModelSession(ModelConfig(path=model_path), device="cuda")


def test_cuda_requested_without_a_usable_gpu_reports_cpu(sample_assets, caplog):
    model = cuda_session(sample_assets.model)
    try:
        if "CUDAExecutionProvider" in model.providers:
            pytest.skip("CUDA is usable here: the GPU test below applies")
        assert model.device == "cpu"
        assert model.providers == ["CPUExecutionProvider"]
        assert "CUDA was asked for" in caplog.text
    finally:
        model.close()


def test_cuda_scores_equal_cpu_scores(sample_assets):
    model = cuda_session(sample_assets.model)
    cpu = ModelSession(ModelConfig(path=sample_assets.model))
    try:
        if "CUDAExecutionProvider" not in model.providers:
            pytest.skip(f"no usable CUDA here (available: {ort.get_available_providers()})")
        assert model.device == "cuda"
        batch = feeds(np.random.default_rng(2).random((256, len(FEATURE_NAMES)), dtype=np.float32))
        on_gpu = [a["score"] for a in model.run(batch)]
        on_cpu = [a["score"] for a in cpu.run(batch)]
        np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-4, atol=1e-5)
    finally:
        model.close()
        cpu.close()


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="headrace models train"):
        ModelSession(ModelConfig(path=tmp_path / "absent.onnx"))


# --- a model without headrace metadata, described by the config ------------------------

COLOURS = ("red", "green", "blue")
PLAIN_INPUTS = [
    {"name": "colour", "dtype": "string", "columns": ["colour"]},
    {"name": "size", "dtype": "int64", "columns": ["size"]},
]


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """A tiny scikit-learn pipeline (one-hot string column, int column passed through, a
    3-class logistic regression) exported by plain skl2onnx, ZipMap on; and its rows."""
    import pandas as pd
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import Int64TensorType, StringTensorType
    from sklearn.compose import ColumnTransformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder

    rng = np.random.default_rng(5)
    rows = pd.DataFrame(
        {
            "colour": rng.choice(COLOURS, 90).astype(object),
            "size": rng.integers(0, 10, 90).astype(np.int64),
        }
    )
    # Small things are cheap, large red or green ones dear, large blue ones mid.
    labels = np.where(
        rows["size"] < 4, "cheap", np.where(rows["colour"] == "blue", "mid", "dear")
    ).astype(object)
    pipeline = Pipeline(
        [
            (
                "columns",
                ColumnTransformer(
                    [
                        ("colour", OneHotEncoder(handle_unknown="ignore"), ["colour"]),
                        ("size", "passthrough", ["size"]),
                    ]
                ),
            ),
            ("classifier", LogisticRegression(max_iter=1_000)),
        ]
    )
    pipeline.fit(rows, labels)
    artifact = to_onnx(
        pipeline,
        initial_types=[
            ("colour", StringTensorType([None, 1])),
            ("size", Int64TensorType([None, 1])),
        ],
        target_opset={"": 17, "ai.onnx.ml": 3},
    )
    path = tmp_path_factory.mktemp("plain") / "shop.onnx"
    path.write_bytes(artifact.SerializeToString())
    return path, pipeline, rows.iloc[:20]


def test_a_model_without_metadata_answers_as_scikit_learn_does(plain_model):
    path, pipeline, rows = plain_model
    config = ModelConfig(path=path, inputs=PLAIN_INPUTS, output={"task": "multiclass", "top_k": 2})
    session = ModelSession(config, warmup_batch_sizes=(1, 20))
    try:
        signature = session.signature
        assert (signature.name, signature.version) == ("shop", "1")
        output = signature.output
        assert output.zipmap and output.tensor == "output_probability"
        # Learned from the ZipMap's keys at warm-up: scikit-learn's sorted classes.
        assert output.classes == tuple(pipeline.classes_) == ("cheap", "dear", "mid")

        answers = session.run(
            {
                "colour": rows["colour"].to_numpy(dtype=object).reshape(-1, 1),
                "size": rows["size"].to_numpy(dtype=np.int64).reshape(-1, 1),
            }
        )
    finally:
        session.close()
    expected_labels = pipeline.predict(rows)
    expected = pipeline.predict_proba(rows)
    assert [a["label"] for a in answers] == list(expected_labels)
    assert len(set(expected_labels)) == 3  # the rows exercise every class
    for answer, probabilities in zip(answers, expected, strict=True):
        top = answer["top_classes"]
        assert len(top) == 2
        assert top[0]["probability"] >= top[1]["probability"]
        assert answer["score"] == top[0]["probability"]
        assert answer["label"] == top[0]["label"]
        for entry in top:
            column = list(pipeline.classes_).index(entry["label"])
            assert entry["probability"] == pytest.approx(probabilities[column], abs=1e-5)
        assert top[1]["probability"] == pytest.approx(np.sort(probabilities)[-2], abs=1e-5)


def test_a_model_without_metadata_refuses_a_config_that_does_not_fit(plain_model):
    path, _, _ = plain_model
    wrong = [{**PLAIN_INPUTS[0], "dtype": "float32"}, PLAIN_INPUTS[1]]
    config = ModelConfig(path=path, inputs=wrong, output={"task": "multiclass"})
    with pytest.raises(ModelError, match=r"'colour'.*set dtype to string"):
        ModelSession(config)
