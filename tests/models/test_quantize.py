"""`headrace models quantize`'s parts on the sample model: the int8 copy, its report,
and the copy as a registry version a pipeline can serve as its fallback rung."""

from __future__ import annotations

import pytest

from models.config import ModelConfig, ModelRegistryConfig
from models.quantize import BATCH_SIZES, quantize, report
from models.registry import FolderRegistry, resolve_model
from models.session import ModelSession
from models.train import held_out

pytestmark = pytest.mark.timeout(120)

# Dynamic int8 quantization of the sample MLP moves its held-out AUC by about 0.001.
AUC_BOUND = 0.01


def test_the_int8_sample_model_keeps_its_auc_and_registers_as_a_fallback(sample_assets, tmp_path):
    int8 = quantize(sample_assets.model, tmp_path / "fraud-mlp.int8.onnx")
    frame, labels = held_out(sample_assets.world, n_samples=5_000)
    figures = report(sample_assets.model, int8, frame, labels)

    assert figures["metric"] == "auc" and figures["held_out_rows"] == 5_000
    assert 0.6 < figures["auc_float"] < 1
    assert abs(figures["auc_int8"] - figures["auc_float"]) <= AUC_BOUND, figures
    for role in ("float", "int8"):
        latency = figures["batch_latency_ms"][role]
        assert set(latency) == {str(size) for size in BATCH_SIZES}
        assert all(ms > 0 for ms in latency.values()), latency
    assert int8.stat().st_size < sample_assets.model.stat().st_size

    registry = FolderRegistry(tmp_path / "registry")
    registry.register("fraud-mlp", sample_assets.model, {})
    version = registry.register("fraud-mlp", int8, {"quantized_from": "1"})
    fallback = ModelConfig(name="fraud-mlp", version=version,
                           registry=ModelRegistryConfig(root=registry.root))  # fmt: skip
    session = ModelSession(resolve_model(fallback))
    try:
        assert session.signature.version == "2"
        assert session.signature.output.task == "binary"
        assert 0 <= session.run(session.zero_feeds(3))[0]["score"] <= 1
    finally:
        session.close()
