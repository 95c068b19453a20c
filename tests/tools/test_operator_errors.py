"""What an operator sees when a command cannot do its job: the real `headrace` command,
one line naming the problem with a hint, no traceback, and the documented exit status
(README, "Exit statuses")."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
import yaml

from infra.ports import free_port
from infra.topics import set_topic_config
from tests.helpers import COMMAND_TIMEOUT_S, Finished, headrace, wait_until
from tools.deploy import sample_config

EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_NOT_DELIVERED, EXIT_INTERRUPTED = 2, 69, 75, 130


def assert_refused(done: Finished, code: int, *expected: str) -> str:
    """The command ended with `code` and, last, one `headrace:` line holding `expected`
    and a hint; nothing of a traceback anywhere."""
    assert "Traceback" not in done.output, done.output
    assert done.code == code, done.output
    message = done.lines[-1]
    assert message.startswith("headrace: "), done.output
    for part in (*expected, "hint: "):
        assert part in message, done.output
    return message


# --- a broker nothing listens on -----------------------------------------------------


@pytest.fixture
def unreachable_config(tmp_path) -> Path:
    """A config whose broker is a loopback port nothing listens on, found within 1 s."""
    raw = sample_config(f"127.0.0.1:{free_port()}", tmp_path / "repo", tmp_path / "m.onnx")
    raw["broker"]["connect_timeout_ms"] = 1_000
    path = tmp_path / "headrace.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize(
    "command",
    [
        ["worker"],
        ["audit"],
        ["topics", "create"],
        ["produce", "--duration", "1"],
        ["consume"],
        ["models", "status"],
        ["models", "deploy", "fraud", "2"],
        ["models", "promote", "fraud"],
        ["models", "rollback", "fraud"],
    ],
    ids=lambda command: " ".join(command),
)
def test_an_unreachable_broker_is_named_in_one_line_within_seconds(
    unreachable_config, tmp_path, command
):
    done = headrace(*command, "-c", str(unreachable_config), cwd=tmp_path)
    bootstrap = yaml.safe_load(unreachable_config.read_text())["broker"]["bootstrap_servers"]
    message = assert_refused(
        done,
        EXIT_UNAVAILABLE,
        f"Kafka at {bootstrap} could not be reached within 1 s (Connection refused)",
        "broker.bootstrap_servers",
    )
    # Not a line of librdkafka's retries before it (a worker printed ~290).
    assert done.lines == [message]


def test_a_bench_against_an_unreachable_broker_says_so_in_one_line(tmp_path):
    bootstrap = f"127.0.0.1:{free_port()}"
    done = headrace("bench", "--bootstrap", bootstrap, "--out", str(tmp_path), cwd=tmp_path)
    message = assert_refused(
        done, EXIT_UNAVAILABLE, f"Kafka at {bootstrap} could not be reached within 5 s"
    )
    assert done.lines == [message]


def test_a_config_error_exits_2(tmp_path):
    path = tmp_path / "headrace.yaml"
    path.write_text("pipelines: []\n")
    done = headrace("audit", "-c", str(path), cwd=tmp_path)
    assert "Traceback" not in done.output
    assert done.code == EXIT_USAGE, done.output
    assert done.lines == [f"headrace: {path}: pipelines: List should have at least 1 item "
                          "after validation, not 0"]  # fmt: skip


# --- a broker that answers ------------------------------------------------------------


@pytest.mark.integration
def test_produce_counts_what_kafka_refused_and_exits_75(deploy, kafka, tmp_path):
    deployment = deploy(partitions=1)
    topic = deployment.spec.input_topic
    # Every event is larger than the topic takes: each delivery fails.
    set_topic_config(kafka.bootstrap_servers, topic, {"max.message.bytes": "20"})
    done = headrace(
        "produce", "-c", str(deployment.config_file), "--rate", "20", "--duration", "1",
        cwd=tmp_path,
    )  # fmt: skip
    assert_refused(
        done,
        EXIT_NOT_DELIVERED,
        f"0 of 20 events delivered to {topic} (20 failed: Broker: Message size too large; "
        "0 unconfirmed)",
    )


@pytest.mark.integration
def test_produce_says_how_many_kafka_acknowledged(deploy, tmp_path):
    deployment = deploy(partitions=1)
    done = headrace(
        "produce", "-c", str(deployment.config_file), "--rate", "20", "--duration", "1",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.code == 0, done.output
    assert f"delivered 20 events to {deployment.spec.input_topic}" in done.lines[-1]


@pytest.mark.integration
def test_a_taken_metrics_port_is_refused_at_start(deploy, tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        deployment = deploy(metrics_port=port)
        done = headrace("worker", "-c", str(deployment.config_file), cwd=tmp_path)
    assert_refused(
        done,
        EXIT_USAGE,
        f"metrics.port {port}: cannot serve /metrics (Address already in use)",
        "set metrics.port to a free port, or 0",
    )
    assert len(done.lines) == 1, done.output  # refused before any Kafka client started


@pytest.mark.integration
def test_a_missing_input_topic_is_named_and_refused_at_start(deploy, tmp_path):
    deployment = deploy()
    raw = yaml.safe_load(deployment.config_file.read_text())
    missing = f"{deployment.spec.input_topic}-never-created"
    raw["pipelines"][0]["input_topic"] = missing
    deployment.config_file.write_text(yaml.safe_dump(raw))
    done = headrace("worker", "-c", str(deployment.config_file), cwd=tmp_path)
    assert_refused(
        done,
        EXIT_USAGE,
        f"pipeline {deployment.spec.name}: topic '{missing}' does not exist",
        "`headrace topics create -c CONFIG`",
    )
    assert len(done.lines) == 1, done.output  # refused before any model or store loaded


@pytest.mark.integration
def test_a_registry_down_at_a_first_start_is_named_and_the_worker_exits_69(deploy, tmp_path):
    """A worker that never registered its answer schema cannot start without the
    registry (it frames every answer with that schema's id): one line naming the
    registry, why, and how a worker that met it before starts anyway."""
    url = f"http://127.0.0.1:{free_port()}/apis/ccompat/v7"
    deployment = deploy(registry_url=url)
    done = headrace("worker", "-c", str(deployment.config_file), cwd=tmp_path)
    assert_refused(
        done,
        EXIT_UNAVAILABLE,
        f"schema registry at {url} could not be reached (Connection refused)",
        "`headrace registry start`",
        "registry.known_schemas_file",
    )


@pytest.mark.integration
def test_a_model_column_from_nowhere_is_refused_at_start(deploy, sample_assets, tmp_path):
    """A column of `model.inputs` that names neither an event field nor a feature (a
    typo) is refused before anything is served, naming the column and where it looked."""
    artifact = onnx.load(str(sample_assets.model))
    names = json.loads(next(p.value for p in artifact.metadata_props if p.key == "feature_names"))
    typo = f"{names[-1]}x"
    deployment = deploy()
    raw = yaml.safe_load(deployment.config_file.read_text())
    raw["pipelines"][0]["model"]["inputs"] = [{"name": "X", "columns": [*names[:-1], typo]}]
    deployment.config_file.write_text(yaml.safe_dump(raw))
    done = headrace("worker", "-c", str(deployment.config_file), cwd=tmp_path)
    assert_refused(
        done,
        EXIT_USAGE,
        f"column '{typo}' is neither a field of the event",
        f"hint: did you mean '{names[-1]}'?",
    )


def _narrowed(model: Path, out: Path, symbolic_width: bool) -> Path:
    """The sample model with one feature name fewer in its metadata than its graph takes;
    with `symbolic_width`, a graph that does not declare its width either."""
    artifact = onnx.load(str(model))
    for prop in artifact.metadata_props:
        if prop.key in ("feature_names", "feature_defaults"):
            prop.value = json.dumps(json.loads(prop.value)[:-1])
    if symbolic_width:
        artifact.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "features"
    onnx.save(artifact, str(out))
    return out


@pytest.mark.integration
@pytest.mark.parametrize(
    ("symbolic_width", "expected"),
    [
        (False, "input 'X' takes 10 columns, its metadata's feature_names give 9"),
        (
            True,
            "failed on a row of zeros (input 'X' 9 columns, from its metadata's "
            "feature_names): INVALID_ARGUMENT",
        ),
    ],
    ids=["declared-width", "symbolic-width"],
)
def test_a_model_narrower_than_its_metadata_is_refused_at_start(
    deploy, sample_assets, tmp_path, symbolic_width, expected
):
    model = _narrowed(sample_assets.model, tmp_path / "narrow.onnx", symbolic_width)
    deployment = deploy(model_path=model)
    done = headrace("worker", "-c", str(deployment.config_file), cwd=tmp_path)
    assert_refused(done, EXIT_USAGE, "pipeline fraud cannot start: model narrow.onnx", expected)
    assert not any("onnxruntime" in line for line in done.lines), done.output


def _catches_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1]
    caught = int(mask, 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_worker_stopped_while_it_still_imports_exits_cleanly(unreachable_config, tmp_path):
    """A SIGTERM in the seconds a worker spends importing (Feast, ONNX Runtime, Faust)
    is a clean stop, exit 0, not a death by signal (-15)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")}
    worker = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "worker", "-c", str(unreachable_config)],
        cwd=Path(__file__).parents[2], env=environment, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _catches_sigterm(worker.pid):
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)  # polling the process's state, not synchronising with it
        maps = Path(f"/proc/{worker.pid}/maps").read_text()
        assert "onnxruntime" not in maps, "SIGTERM is handled only once the imports are done"
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=COMMAND_TIMEOUT_S)
    finally:
        worker.kill()
    assert worker.returncode == 0, output


# --- local services ---------------------------------------------------------------------


@pytest.mark.integration
def test_broker_start_on_other_ports_while_it_runs_is_refused_naming_its_ports(kafka, tmp_path):
    """The session's broker, asked for by the real command with its state folder: other
    ports are refused (it used to report the broker ready on them), its own are fine."""
    state = str(kafka.state_dir)
    pid = kafka.process.pid()
    own = ["--port", str(kafka.port), "--controller-port", str(kafka.controller_port)]
    other = free_port()
    refused = headrace("broker", "start", "--state-dir", state, "--port", str(other),
                       "--controller-port", str(kafka.controller_port), cwd=tmp_path)  # fmt: skip
    message = assert_refused(
        refused,
        EXIT_USAGE,
        f"kafka already runs (pid {pid}) with {' '.join(own)}, not --port {other}",
        f"stop it first (`headrace broker stop --state-dir {state}`), or start it with "
        f"{' '.join(own)}",
    )
    assert refused.lines == [message]
    assert kafka.process.pid() == pid and kafka.ready()
    again = headrace("broker", "start", "--state-dir", state, *own, cwd=tmp_path)
    assert again.code == 0, again.output
    assert again.lines == [
        f"broker already running at {kafka.bootstrap_servers} (pid {pid}); state in {state}"
    ]


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_produce_interrupted_flushes_what_it_sent_says_so_and_exits_130(deploy, kafka, tmp_path):
    deployment = deploy(partitions=1)
    topic = deployment.spec.input_topic
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")}
    producing = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "produce", "-c", str(deployment.config_file),
         "--rate", "2000", "--duration", "60"],
        cwd=Path(__file__).parents[2], env=environment, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # Ctrl-C as a terminal sends it: a test run in the background (CI) ignores
        # SIGINT, and Python would keep it ignored in the child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        # Interrupted mid-run, with events in flight: some already on the topic.
        assert wait_until(
            lambda: producing.poll() is not None or _on_topic(kafka.bootstrap_servers, topic) > 0,
            COMMAND_TIMEOUT_S,
        )
        assert producing.poll() is None, producing.communicate()[0]
        producing.send_signal(signal.SIGINT)
        output, _ = producing.communicate(timeout=COMMAND_TIMEOUT_S)
    finally:
        producing.kill()
    assert "Traceback" not in output, output
    assert producing.returncode == EXIT_INTERRUPTED, output
    last = output.replace("\r", "\n").splitlines()[-1]
    found = re.fullmatch(
        rf"headrace: interrupted after [\d.]+ s: sent (\d+) events to {topic}, (\d+) "
        r"delivered \(0 failed, 0 unconfirmed\)",
        last,
    )
    assert found, output
    sent, delivered = int(found[1]), int(found[2])
    assert 0 < sent == delivered < 2000 * 120
    # Flushed: every event it counted is on the topic (it is gone: nothing adds more).
    on_topic = wait_until(lambda: _on_topic(kafka.bootstrap_servers, topic) >= 0, 30)
    assert on_topic and _on_topic(kafka.bootstrap_servers, topic) == delivered


def _on_topic(bootstrap: str, topic: str) -> int:
    """Records on partition 0 of `topic`: its high watermark (no group coordinator asked,
    which a young broker may not have ready); -1 while its leader is not known yet."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "headrace-tests-none"})
    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
    except KafkaException:
        return -1
    finally:
        consumer.close()
