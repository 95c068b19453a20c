"""The local service launchers and topic creation, against the session's real broker."""

from __future__ import annotations

import json
import urllib.request
import uuid

import pytest
from confluent_kafka.admin import AdminClient

from infra.topics import delete_topics, ensure_topics
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def test_start_on_a_running_broker_is_a_no_op(kafka):
    pid = kafka.process.pid()
    assert pid is not None
    assert kafka.start() == 0.0
    assert kafka.process.pid() == pid
    assert kafka.ready()


def test_topics_get_the_partition_counts_asked_for(kafka):
    suffix = uuid.uuid4().hex[:8]
    names = {f"one-{suffix}": 1, f"four-{suffix}": 4}
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    try:
        assert sorted(ensure_topics(kafka.bootstrap_servers, names)) == sorted(names)
        assert ensure_topics(kafka.bootstrap_servers, names) == []
        topics = admin.list_topics(timeout=10).topics
        for name, partitions in names.items():
            assert len(topics[name].partitions) == partitions
    finally:
        delete_topics(kafka.bootstrap_servers, names)
    assert wait_until(
        lambda: not set(names) & set(admin.list_topics(timeout=10).topics), timeout_s=30
    )


def test_registry_serves_the_confluent_api(registry):
    assert registry.ready()
    assert registry.url.endswith("/apis/ccompat/v7")


def register(registry, subject: str, schema: dict) -> int:
    request = urllib.request.Request(
        f"{registry.url}/subjects/{subject}/versions",
        data=json.dumps({"schema": json.dumps(schema)}).encode(),
        headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)["id"]


def test_registry_keeps_its_ids_across_a_restart(registry):
    before = {"type": "record", "name": "Before", "fields": [{"name": "x", "type": "int"}]}
    after = {"type": "record", "name": "After", "fields": [{"name": "y", "type": "long"}]}
    first = register(registry, "durable-before-value", before)
    registry.stop()
    assert not registry.ready()
    registry.start()
    with urllib.request.urlopen(f"{registry.url}/schemas/ids/{first}", timeout=10) as answer:
        assert json.loads(json.load(answer)["schema"]) == before
    # An in-memory registry would hand `first` out again here.
    assert register(registry, "durable-after-value", after) != first
    assert register(registry, "durable-before-value", before) == first


def test_redis_commands_start_and_stop_a_server(tmp_path):
    from click.testing import CliRunner

    from infra.ports import free_port
    from infra.redis import RedisServer
    from tools.cli import cli

    port = free_port()
    runner = CliRunner()
    arguments = ["redis", "start", "--state-dir", str(tmp_path), "--port", str(port)]
    started = runner.invoke(cli, arguments)
    assert started.exit_code == 0, started.output
    assert f"ready at 127.0.0.1:{port}" in started.output
    assert RedisServer(tmp_path, port).ready()
    stopped = runner.invoke(cli, ["redis", "stop", "--state-dir", str(tmp_path)])
    assert "redis stopped" in stopped.output
    assert not RedisServer(tmp_path, port).ready()


def test_a_bad_config_is_one_clear_line_and_status_2(tmp_path, capsys, monkeypatch):
    import sys

    from tools.cli import main

    config = tmp_path / "bad.yaml"
    config.write_text("pipelines: []\n")
    monkeypatch.setattr(sys, "argv", ["headrace", "topics", "create", "-c", str(config)])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    assert f"headrace: {config}: pipelines:" in capsys.readouterr().err
