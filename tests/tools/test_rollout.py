"""`headrace models deploy` against a folder registry, the control topic faked."""

from __future__ import annotations

import time
from pathlib import Path

from models.registry import FolderRegistry
from streams.config import HeadraceConfig
from streams.control import Desired, Report
from tools import rollout
from tools.deploy import sample_config


def registry_with_three_versions(tmp_path: Path) -> tuple[FolderRegistry, Path]:
    """A folder registry holding versions 1 to 3 of `fraud-mlp`, and their artifact."""
    registry = FolderRegistry(tmp_path / "registry")
    artifact = tmp_path / "m.onnx"
    artifact.write_bytes(b"onnx")
    for _ in range(3):
        registry.register("fraud-mlp", artifact, {})
    return registry, artifact


def test_deploying_an_alias_writes_the_version_it_names_now(tmp_path, monkeypatch):
    registry, artifact = registry_with_three_versions(tmp_path)
    registry.set_alias("fraud-mlp", "champion", "2")
    raw = sample_config("k:9092", Path("repo"), artifact)
    raw["pipelines"][0]["model"] = {"name": "fraud-mlp", "version": "1",
                                    "registry": {"root": str(registry.root)}}  # fmt: skip
    config = HeadraceConfig.model_validate(raw)
    written = []
    monkeypatch.setattr(rollout, "desired_states", lambda _config: {})

    def change(_config, _pipeline, build):
        written.append(build())
        return written[-1]

    monkeypatch.setattr(rollout, "change_desired", change)

    desired = rollout.deploy(config, config.pipelines[0], "@champion")
    # Workers running when the alias moves keep serving v2, as do those started later.
    assert desired.serving == "2" and [d.serving for d in written] == ["2"]
    registry.set_alias("fraud-mlp", "champion", "3")
    assert rollout.deploy(config, config.pipelines[0], "@champion", "canary", 5).candidate == "3"


def test_a_worker_silent_while_it_loads_the_version_is_still_waited_for(monkeypatch):
    """Worker b loads the new version and sends no heartbeat meanwhile: a wait that
    dropped it as gone reported the deploy applied while b served the old version."""
    config = HeadraceConfig.model_validate(sample_config("k:9092", Path("repo"), Path("m.onnx")))
    spec = config.pipelines[0]
    now_ms = int(time.time() * 1000)
    silent_ms = now_ms - 60_000
    polls = [
        [Report("a", spec.name, "1", revision=6, sent_ms=now_ms),
         Report("b", spec.name, "1", revision=6, sent_ms=now_ms)],
        [Report("a", spec.name, "2", revision=7, sent_ms=now_ms),
         Report("b", spec.name, "1", revision=6, sent_ms=silent_ms)],
    ]  # fmt: skip
    # The first poll as the wait begins, the second from then on.
    monkeypatch.setattr(
        rollout, "worker_reports", lambda _config: polls.pop(0) if len(polls) > 1 else polls[0]
    )
    monkeypatch.setattr(rollout, "_POLL_S", 0.0)
    desired = Desired(spec.name, "2", revision=7)
    found = rollout.applied(config, spec, desired, timeout_s=0.05)
    assert ([r.worker for r in found.reports], found.pending) == (["a"], 1)
