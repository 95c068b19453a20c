"""Where a model version comes from: a model given by name and version (or `@alias`)
is looked up in a model registry and becomes a config naming a local `.onnx` file.

Two registries:
- a folder (the default): `<root>/<name>/<version>/model.onnx`, with the version's
  metadata in `meta.json` beside it and aliases in `<root>/<name>/aliases.json`
  (`{"champion": "3"}`); `@latest` is the highest version number;
- the MLflow Model Registry (`registry.mlflow_uri`): `models:/<name>/<version>` or
  `models:/<name>@<alias>`, downloaded once into `registry.cache_dir`.

Every call blocks (files, and the MLflow server within `registry.timeout_s`); call it
off the event loop. Failures are ModelError, naming the model and what exists.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Protocol

from models.config import ModelConfig, ModelRegistryConfig
from models.errors import ModelError

ARTIFACT = "model.onnx"


def model_name(config: ModelConfig) -> str:
    """The name a model has in its registry: its `name`, else its file's stem."""
    return config.name or config.path.stem


def resolve_model(config: ModelConfig) -> ModelConfig:
    """A config naming a local artifact and a concrete version: `config` itself when
    it names a file, else the registry's version (an alias resolved) made local."""
    if config.path is not None:
        return config
    version, path = open_registry(config.registry).locate(config.name, config.version)
    return config.model_copy(update={"path": path, "version": version})


def with_version(config: ModelConfig, version: str) -> ModelConfig:
    """The same model (sessions, inputs, output, registry) at another registry version."""
    return config.model_copy(update={"path": None, "name": model_name(config), "version": version})


class ModelRegistry(Protocol):
    def locate(self, name: str, version: str) -> tuple[str, Path]:
        """(the version, its local `.onnx`) of a version or `@alias`."""
        ...

    def register(self, name: str, artifact: Path, metadata: dict[str, str]) -> str:
        """Add `artifact` as the next version of `name`; the version."""
        ...

    def set_alias(self, name: str, alias: str, version: str) -> None: ...


def open_registry(config: ModelRegistryConfig) -> ModelRegistry:
    if config.mlflow_uri is not None:
        return MlflowRegistry(config)
    return FolderRegistry(config.root)


class FolderRegistry:
    def __init__(self, root: Path) -> None:
        self.root = root

    def versions(self, name: str) -> list[str]:
        folder = self.root / name
        if not folder.is_dir():
            return []
        found = [p.name for p in folder.iterdir() if (p / ARTIFACT).is_file()]
        return sorted(found, key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0, v))

    def _aliases(self, name: str) -> dict[str, str]:
        try:
            return json.loads((self.root / name / "aliases.json").read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ModelError(f"model registry {self.root}: aliases of {name}: {exc}") from exc

    def locate(self, name: str, version: str) -> tuple[str, Path]:
        known = self.versions(name)
        if version.startswith("@"):
            alias = version[1:]
            aliases = self._aliases(name)
            if alias in aliases:
                version = aliases[alias]
            elif alias == "latest" and known:
                version = known[-1]
            else:
                raise ModelError(
                    f"model {name}: no alias {alias!r} in {self.root} (aliases: "
                    f"{sorted(aliases)}); hint: `headrace models register --alias`"
                )
        path = self.root / name / version / ARTIFACT
        if not path.is_file():
            raise ModelError(
                f"model {name} version {version} is not in {self.root} (versions: {known}); "
                f"hint: `headrace models register {name} FILE.onnx`"
            )
        return version, path

    def register(self, name: str, artifact: Path, metadata: dict[str, str]) -> str:
        numbers = [int(v) for v in self.versions(name) if v.isdigit()]
        version = str(max(numbers, default=0) + 1)
        folder = self.root / name / version
        folder.mkdir(parents=True)
        shutil.copyfile(artifact, folder / ARTIFACT)
        meta = {"source": str(artifact), "registered_ms": int(time.time() * 1000), **metadata}
        (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        return version

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.locate(name, version)
        aliases = {**self._aliases(name), alias: version}
        (self.root / name / "aliases.json").write_text(json.dumps(aliases, indent=2) + "\n")


class MlflowRegistry:
    """The MLflow Model Registry of a tracking server (needs the `mlflow` extra)."""

    def __init__(self, config: ModelRegistryConfig) -> None:
        # MLflow's HTTP calls read their timeout and retries from the environment only.
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, int(config.timeout_s)))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        try:
            from mlflow import MlflowClient
        except ImportError as exc:
            raise ModelError(
                "registry.mlflow_uri needs MLflow; hint: pip install 'headrace[mlflow]'"
            ) from exc
        self._uri = config.mlflow_uri
        self._cache = config.cache_dir
        self._client = MlflowClient(tracking_uri=config.mlflow_uri, registry_uri=config.mlflow_uri)

    def _call(self, what: str, call):
        try:
            return call()
        except Exception as exc:  # MlflowException, or the HTTP client's own errors
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ModelError(f"MLflow at {self._uri}: {what}: {message}") from exc

    def locate(self, name: str, version: str) -> tuple[str, Path]:
        if version.startswith("@"):
            found = self._call(
                f"alias {version} of {name}",
                lambda: self._client.get_model_version_by_alias(name, version[1:]),
            )
        else:
            found = self._call(
                f"models:/{name}/{version}", lambda: self._client.get_model_version(name, version)
            )
        version = str(found.version)
        folder = self._cache / name / version
        path = folder / ARTIFACT
        if not path.is_file():  # versions never change: downloaded once
            self._download(name, version, folder)
        return version, path

    def _download(self, name: str, version: str, folder: Path) -> None:
        import mlflow.artifacts

        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = folder.with_name(f".{version}.{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)

        def download() -> None:
            source = self._client.get_model_version_download_uri(name, version)
            mlflow.artifacts.download_artifacts(
                artifact_uri=source, dst_path=str(staging), tracking_uri=self._uri
            )

        self._call(f"downloading models:/{name}/{version}", download)
        found = sorted(staging.rglob("*.onnx"))
        if not found:
            shutil.rmtree(staging, ignore_errors=True)
            raise ModelError(f"MLflow models:/{name}/{version} holds no .onnx file")
        shutil.move(found[0], staging / ARTIFACT)
        if folder.exists():  # another worker of this host was first
            shutil.rmtree(staging)
        else:
            staging.replace(folder)

    def register(self, name: str, artifact: Path, metadata: dict[str, str]) -> str:
        client = self._client

        def run() -> str:
            experiment = client.get_experiment_by_name("headrace")
            experiment_id = (
                experiment.experiment_id if experiment else client.create_experiment("headrace")
            )
            logged = client.create_run(experiment_id, run_name=f"register {name}")
            client.log_artifact(logged.info.run_id, str(artifact), "model")
            client.set_terminated(logged.info.run_id)
            if not client.search_registered_models(f"name = '{name}'"):
                client.create_registered_model(name)
            return client.create_model_version(
                name,
                f"{logged.info.artifact_uri}/model",
                logged.info.run_id,
                tags=metadata,
                await_creation_for=0,
            ).version

        return str(self._call(f"registering {artifact} as {name}", run))

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self._call(
            f"alias {alias} of {name}",
            lambda: self._client.set_registered_model_alias(name, alias, version),
        )
