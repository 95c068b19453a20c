"""Two `headrace models` commands changing one pipeline at once, through a real broker:
one of them fails, neither change is silently lost."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from infra.topics import delete_topics
from streams.config import HeadraceConfig
from streams.control import ConcurrentChange, desired_states
from tests.tools.test_rollout import registry_with_three_versions
from tools import rollout
from tools.deploy import sample_config

pytestmark = pytest.mark.integration


@pytest.fixture
def config(kafka, tmp_path):
    """A pipeline whose registry holds versions 1 to 3, with its own control topics."""
    registry, artifact = registry_with_three_versions(tmp_path)
    suffix = uuid.uuid4().hex[:8]
    raw = sample_config(kafka.bootstrap_servers, Path("repo"), artifact)
    raw["pipelines"][0]["model"] = {"name": "fraud-mlp", "version": "1",
                                    "registry": {"root": str(registry.root)}}  # fmt: skip
    raw["control"] = {"topic": f"control-{suffix}", "status_topic": f"control-status-{suffix}"}
    found = HeadraceConfig.model_validate(raw)
    yield found
    delete_topics(kafka.bootstrap_servers, [found.control.topic, found.control.status_topic])


def test_a_deploy_overtaken_by_another_fails_instead_of_being_lost(config, monkeypatch):
    """Deploy A reads revision 1; deploy B runs to its end meanwhile (it read revision 1
    too, and wrote revision 2). A must not write revision 2 over B's."""
    spec = config.pipelines[0]
    assert rollout.deploy(config, spec, "2").revision == 1
    read = rollout.current
    overtaken: list = []
    reads = []

    def current_then_another_deploy(config, spec):
        found = read(config, spec)
        reads.append(found.revision)
        if len(reads) == 1:  # A's read; B's own reads go through
            overtaken.append(rollout.deploy(config, spec, "3", "canary", 10))
        return found

    monkeypatch.setattr(rollout, "current", current_then_another_deploy)
    with pytest.raises(ConcurrentChange, match="run the command again") as failed:
        rollout.deploy(config, spec, "1")
    assert failed.value.exit_status == 75
    [other] = overtaken
    assert reads == [1, 1]
    assert (other.revision, other.candidate) == (2, "3")
    assert desired_states(config)[spec.name] == other  # B's change stands, A wrote nothing
    monkeypatch.setattr(rollout, "current", read)
    # Run again, A builds on B's change.
    again = rollout.deploy(config, spec, "1")
    assert (again.revision, again.serving, again.previous) == (3, "1", "2")
