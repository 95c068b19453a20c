"""The control follower against a real broker: changes written in transactions are
followed, and so is a control topic deleted and recreated (its revisions start at 1)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from infra.kafka_clients import list_topics
from infra.topics import delete_topics
from streams.config import HeadraceConfig
from streams.control import (
    ControlFollower,
    Desired,
    change_desired,
    desired_states,
    ensure_control_topics,
)
from tests.helpers import wait_until
from tools.deploy import sample_config

pytestmark = pytest.mark.integration


@pytest.fixture
def config(kafka):
    suffix = uuid.uuid4().hex[:8]
    raw = sample_config(kafka.bootstrap_servers, Path("repo"), Path("m.onnx"))
    raw["control"] = {"topic": f"control-{suffix}", "status_topic": f"control-status-{suffix}",
                      "heartbeat_interval_s": 0.2}  # fmt: skip
    found = HeadraceConfig.model_validate(raw)
    yield found
    delete_topics(kafka.bootstrap_servers, [found.control.topic, found.control.status_topic])


def deploy(config: HeadraceConfig, version: str) -> Desired:
    """`headrace models deploy fraud VERSION`, as tools/rollout.py writes it."""
    return change_desired(
        config,
        "fraud",
        lambda: (desired_states(config).get("fraud") or Desired("fraud")).deploy(version, None, 0),
    )


def test_a_recreated_control_topic_is_followed_with_its_revisions_from_1(config):
    bootstrap = config.broker.bootstrap_servers
    for version in ("2", "3", "4"):
        deploy(config, version)
    applied: list[Desired] = []
    follower = ControlFollower(config, ["fraud"], applied.append, list)
    follower.catch_up()
    follower.start()
    try:
        assert [(d.revision, d.serving) for d in applied] == [(3, "4")]
        assert deploy(config, "5").revision == 4  # read committed: followed
        assert wait_until(lambda: applied[-1].revision == 4, 10), applied
        # An operator resets the control topic; the next deploy is revision 1 again.
        delete_topics(bootstrap, [config.control.topic])
        assert wait_until(lambda: config.control.topic not in list_topics(bootstrap), 30)
        ensure_control_topics(config)
        assert deploy(config, "7").revision == 1
        assert wait_until(lambda: applied[-1].serving == "7", 20), applied
        assert follower._thread.is_alive()
    finally:
        follower.stop()
