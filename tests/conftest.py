"""Real services for the integration tests: one Kafka broker, one schema registry, one
Zipkin server, and the sample Feast store and model, each started once per session on
free loopback ports.
Each test gets its own topics (a unique suffix) and removes them afterwards.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from features.sample_data import SampleWorld
from features.store import prepare_sample_store
from infra.jaeger import JaegerServer, jaeger_binary
from infra.kafka import KafkaBroker
from infra.mlflow import MlflowServer
from infra.ports import free_port
from infra.redis import RedisServer
from infra.registry import SchemaRegistryServer
from infra.topics import delete_topics
from infra.zipkin import ZipkinServer
from models.train import fallback_path
from streams.app import create_topics
from streams.config import HeadraceConfig
from tools.deploy import (
    prepare_sample_assets,
    sample_config,
    start_worker,
    stop_worker,
    write_config,
)


@pytest.fixture(scope="session")
def kafka(tmp_path_factory) -> Iterator[KafkaBroker]:
    broker = KafkaBroker(tmp_path_factory.mktemp("kafka"), free_port(), free_port())
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def registry(tmp_path_factory) -> Iterator[SchemaRegistryServer]:
    server = SchemaRegistryServer(tmp_path_factory.mktemp("registry"), free_port(), free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def zipkin(tmp_path_factory) -> Iterator[ZipkinServer]:
    server = ZipkinServer(tmp_path_factory.mktemp("zipkin"), free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory) -> Iterator[JaegerServer]:
    """An OTLP backend, where a Jaeger binary was built beforehand (see infra/jaeger.py)."""
    if jaeger_binary() is None:
        pytest.skip("no Jaeger binary (HEADRACE_JAEGER): it is built from Go modules, "
                    "see infra/jaeger.py")  # fmt: skip
    ports = [free_port() for _ in range(4)]
    server = JaegerServer(tmp_path_factory.mktemp("jaeger"), *ports)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_repo(redis_server, sample_assets, tmp_path_factory) -> Path:
    """The sample features materialized into a Feast repo whose online store is Redis."""
    repo = tmp_path_factory.mktemp("redis-repo")
    prepare_sample_store(repo, sample_assets.world, redis=redis_server.connection_string)
    return repo


@dataclass(frozen=True)
class SampleAssets:
    world: SampleWorld
    repo: Path
    model: Path


@pytest.fixture(scope="session")
def sample_assets(tmp_path_factory) -> SampleAssets:
    world = SampleWorld()
    repo, model = prepare_sample_assets(tmp_path_factory.mktemp("assets"), world)
    return SampleAssets(world, repo, model)


@dataclass
class Deployment:
    """A pipeline config with its own topics, and a way to run workers on it."""

    config: HeadraceConfig
    config_file: Path
    log_file: Path
    started: list[subprocess.Popen] = field(default_factory=list)

    @property
    def spec(self):
        return self.config.pipelines[0]

    def start(self, log_level: str = "warn") -> subprocess.Popen:
        """A worker on this config; one still running when its test ends is killed."""
        process = start_worker(self.config_file, self.log_file, log_level)
        self.started.append(process)
        return process

    def kill_leftovers(self) -> None:
        """Kill the workers a failed test left running (they would load the machine)."""
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.wait()

    @contextmanager
    def worker(self) -> Iterator:
        process = self.start()
        try:
            yield process
        finally:
            code = stop_worker(process)
            assert code == 0, f"worker exited with {code}; log:\n{self.log_tail()}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def deploy(kafka, sample_assets, tmp_path):
    """Factory: `deploy(**sample_config overrides)` creates topics and writes the config
    (with the sample fallback model unless overridden)."""
    created: list[str] = []
    made: list[Deployment] = []

    def make(
        partitions: int = 3,
        model_path: Path | None = None,
        repo_path: Path | None = None,
        **overrides,
    ) -> Deployment:
        suffix = f"-{uuid.uuid4().hex[:8]}"
        overrides.setdefault("fallback_model", fallback_path(sample_assets.model))
        raw = sample_config(
            kafka.bootstrap_servers,
            repo_path or sample_assets.repo,
            model_path or sample_assets.model,
            suffix=suffix,
            **overrides,
        )
        config_file = tmp_path / f"headrace{suffix}.yaml"
        config = write_config(raw, config_file)
        created.extend(create_topics(config, partitions))
        made.append(Deployment(config, config_file, tmp_path / f"worker{suffix}.log"))
        return made[-1]

    yield make
    for deployment in made:
        deployment.kill_leftovers()
    if created:
        delete_topics(kafka.bootstrap_servers, created)
