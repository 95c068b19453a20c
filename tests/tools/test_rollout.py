"""`headrace models deploy` against a folder registry, the control topic faked."""

from __future__ import annotations

from pathlib import Path

from models.registry import FolderRegistry
from streams.config import HeadraceConfig
from tools import rollout
from tools.deploy import sample_config


def test_deploying_an_alias_writes_the_version_it_names_now(tmp_path, monkeypatch):
    registry = FolderRegistry(tmp_path / "registry")
    artifact = tmp_path / "m.onnx"
    artifact.write_bytes(b"onnx")
    for _ in range(3):
        registry.register("fraud-mlp", artifact, {})
    registry.set_alias("fraud-mlp", "champion", "2")
    raw = sample_config("k:9092", Path("repo"), artifact)
    raw["pipelines"][0]["model"] = {"name": "fraud-mlp", "version": "1",
                                    "registry": {"root": str(registry.root)}}  # fmt: skip
    config = HeadraceConfig.model_validate(raw)
    written = []
    monkeypatch.setattr(rollout, "desired_states", lambda _config: {})
    monkeypatch.setattr(rollout, "write_desired", lambda _config, desired: written.append(desired))

    desired = rollout.deploy(config, config.pipelines[0], "@champion")
    # Workers running when the alias moves keep serving v2, as do those started later.
    assert desired.serving == "2" and [d.serving for d in written] == ["2"]
    registry.set_alias("fraud-mlp", "champion", "3")
    assert rollout.deploy(config, config.pipelines[0], "@champion", "canary", 5).candidate == "3"
