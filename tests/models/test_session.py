"""The ONNX model artifact and session: metadata, providers, shapes, concurrency."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest

from models.errors import ModelError
from models.session import ModelSession
from models.train import FEATURE_NAMES, MODEL_NAME


@pytest.fixture(scope="module")
def session(sample_assets):
    model = ModelSession(sample_assets.model, warmup_batch_sizes=(1, 64))
    yield model
    model.close()


def test_artifact_carries_its_metadata(session):
    meta = session.metadata
    assert meta.name == MODEL_NAME
    assert meta.feature_names == FEATURE_NAMES
    assert len(meta.feature_defaults) == len(FEATURE_NAMES)
    assert 0 < meta.threshold < 1


def test_scores_are_probabilities_one_per_row(session):
    rng = np.random.default_rng(0)
    matrix = rng.random((37, len(FEATURE_NAMES)), dtype=np.float32) * 100
    scores = session.predict(matrix)
    assert scores.shape == (37,)
    assert ((scores >= 0) & (scores <= 1)).all()


def test_riskier_inputs_score_higher(session):
    """The sample model learned the synthetic ground truth, not noise."""
    base = np.array(session.metadata.feature_defaults, dtype=np.float32)
    base[0] = 30.0  # amount near the usual spend
    risky = base.copy()
    risky[0] = 3000.0
    risky[FEATURE_NAMES.index("user_stats__chargeback_rate_90d")] = 0.2
    risky[FEATURE_NAMES.index("merchant_stats__risk_score")] = 0.6
    safe_score, risky_score = session.predict(np.stack([base, risky]))
    assert risky_score > safe_score + 0.2


def test_wrong_shape_is_a_clear_error(session):
    with pytest.raises(ModelError, match=r"expected a \(batch, 10\) matrix"):
        session.predict(np.zeros((2, 3), dtype=np.float32))


async def test_async_predictions_match_serial_ones(session):
    rng = np.random.default_rng(1)
    batches = [rng.random((16, len(FEATURE_NAMES)), dtype=np.float32) for _ in range(8)]
    together = await asyncio.gather(*(session.predict_async(b) for b in batches))
    for batch, scores in zip(batches, together, strict=True):
        np.testing.assert_array_equal(scores, session.predict(batch))


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers()
    and ort.get_device() == "GPU"
    and __import__("shutil").which("nvidia-smi") is not None,
    reason="this machine has a usable GPU",
)
def test_cuda_requested_without_a_gpu_reports_cpu(sample_assets, caplog):
    model = ModelSession(sample_assets.model, device="cuda")
    try:
        assert model.device == "cpu"
        assert model.providers == ["CPUExecutionProvider"]
        assert "CUDA was asked for" in caplog.text
    finally:
        model.close()


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="headrace models train"):
        ModelSession(tmp_path / "absent.onnx")
