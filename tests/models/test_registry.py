"""Model versions from a folder registry and from a real MLflow server's Model Registry."""

from __future__ import annotations

import uuid

import pytest

from models.config import ModelConfig, ModelRegistryConfig
from models.errors import ModelError
from models.registry import FolderRegistry, open_registry, resolve_model, with_version
from models.session import load_session, signature_of


def test_a_plain_file_path_is_used_as_it_is(sample_assets):
    config = ModelConfig(path=sample_assets.model)
    assert resolve_model(config) is config


def test_folder_versions_and_aliases(sample_assets, tmp_path):
    registry = ModelRegistryConfig(root=tmp_path / "registry")
    folder = FolderRegistry(registry.root)
    assert folder.register("fraud", sample_assets.model, {"note": "first"}) == "1"
    assert folder.register("fraud", sample_assets.model, {}) == "2"
    folder.set_alias("fraud", "champion", "1")

    for version, expected in (("2", "2"), ("@champion", "1"), ("@latest", "2")):
        resolved = resolve_model(ModelConfig(name="fraud", version=version, registry=registry))
        assert resolved.version == expected
        assert resolved.path == registry.root / "fraud" / expected / "model.onnx"
        # The answers name the registry's version, not the artifact's own metadata.
        assert signature_of(resolved, load_session(resolved)).version == expected

    with pytest.raises(ModelError, match=r"version 7 is not in .*versions: \['1', '2'\]"):
        resolve_model(ModelConfig(name="fraud", version="7", registry=registry))
    with pytest.raises(ModelError, match="no alias 'stable'"):
        resolve_model(ModelConfig(name="fraud", version="@stable", registry=registry))


def test_another_version_of_a_configured_file_keeps_its_settings(sample_assets):
    config = ModelConfig(path=sample_assets.model, cpu_sessions=2)
    other = with_version(config, "3")
    assert (other.path, other.name, other.version, other.cpu_sessions) == (
        None, "fraud-mlp", "3", 2,
    )  # fmt: skip


@pytest.mark.integration
def test_mlflow_versions_and_aliases(mlflow_server, sample_assets, tmp_path):
    registry = ModelRegistryConfig(mlflow_uri=mlflow_server.url, cache_dir=tmp_path / "cache")
    name = f"fraud-{uuid.uuid4().hex[:6]}"
    mlflow = open_registry(registry)
    first = mlflow.register(name, sample_assets.model, {"source": "test"})
    mlflow.set_alias(name, "champion", first)

    by_alias = resolve_model(ModelConfig(name=name, version="@champion", registry=registry))
    assert by_alias.version == first
    assert by_alias.path.read_bytes() == sample_assets.model.read_bytes()
    assert signature_of(by_alias, load_session(by_alias)).version == first

    with pytest.raises(ModelError, match=f"models:/{name}/99"):
        resolve_model(ModelConfig(name=name, version="99", registry=registry))
