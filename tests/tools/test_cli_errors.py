"""The `headrace` command's messages and exit statuses where no broker is needed: Kafka's
clients and the slow parts are replaced by fakes, the command runs through `main()`
(what an operator's shell runs), and what it prints is checked line by line."""

from __future__ import annotations

import datetime
import decimal
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from confluent_kafka import KafkaError, KafkaException

from infra.ports import free_port
from schemas.errors import DecodeError
from tools import cli
from tools.deploy import sample_config


def run(monkeypatch, capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    """Run `headrace ARGV` in-process: its exit status, stdout lines and stderr lines."""
    monkeypatch.setattr(sys, "argv", ["headrace", *argv])
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out.splitlines(), err.splitlines()


@pytest.fixture
def config_path(tmp_path) -> Path:
    raw = sample_config("127.0.0.1:9", tmp_path / "repo", tmp_path / "m.onnx")
    raw["broker"]["connect_timeout_ms"] = 1_000
    path = tmp_path / "headrace.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# --- consume ---------------------------------------------------------------------------


class FakeMessage:
    def __init__(self, offset: int, value: bytes | None) -> None:
        self._offset, self._value = offset, value

    def error(self):
        return None

    def topic(self) -> str:
        return "fraud-scores"

    def partition(self) -> int:
        return 1

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes | None:
        return self._value


class FakeDecoder:
    """Answers as fastavro returns them: logical types and bytes as Python objects."""

    answers = {
        b"good": {
            "event_id": "e-1",
            "score": float("nan"),
            "at": datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.UTC),
            "day": datetime.date(2024, 5, 1),
            "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
            "amount": decimal.Decimal("12.50"),
            "raw": b"\x00\xff",
        }
    }

    def decode(self, raw: bytes | None) -> dict:
        if raw not in self.answers:
            raise DecodeError("bad_magic", "expected magic byte 0, got 120")
        return self.answers[raw]


def fake_consumer(messages: list[FakeMessage]):
    class FakeConsumer:
        def __init__(self, settings: dict) -> None:
            self._left = list(messages)

        def subscribe(self, topics: list[str]) -> None:
            pass

        def poll(self, timeout_s: float):
            if not self._left:
                raise KeyboardInterrupt  # what ends an endless consume: Ctrl-C
            return self._left.pop(0)

        def close(self) -> None:
            pass

    return FakeConsumer


@pytest.fixture
def consume_from(monkeypatch):
    """`headrace consume` reading these messages through a fake consumer."""
    import confluent_kafka

    import tools.answers

    def install(messages: list[FakeMessage]) -> None:
        monkeypatch.setattr(cli, "_require_topic", lambda config, topic: None)
        monkeypatch.setattr(tools.answers, "answer_decoder", lambda config: FakeDecoder())
        monkeypatch.setattr(confluent_kafka, "Consumer", fake_consumer(messages))

    return install


def test_consume_prints_logical_types_and_bytes_as_json_text(
    monkeypatch, capsys, config_path, consume_from
):
    consume_from([FakeMessage(0, b"good")])
    code, out, err = run(monkeypatch, capsys, "consume", "-c", str(config_path))
    assert code == 0, err
    assert out == [
        '{"event_id": "e-1", "score": null, "at": "2024-05-01T12:30:00+00:00", '
        '"day": "2024-05-01", "id": "12345678-1234-5678-1234-567812345678", '
        '"amount": "12.50", "raw": "AP8="}'
    ]


def test_consume_names_each_record_it_cannot_decode_and_reads_on(
    monkeypatch, capsys, config_path, consume_from
):
    consume_from([FakeMessage(3, b"xx-not-avro"), FakeMessage(4, None), FakeMessage(5, b"good")])
    code, out, err = run(
        monkeypatch, capsys, "consume", "-c", str(config_path), "--from-beginning", "--max", "1"
    )
    assert code == 0, err
    assert len(out) == 1 and '"event_id": "e-1"' in out[0]
    assert err == [
        "headrace: fraud-scores[1]@3: skipped, not an answer (expected magic byte 0, got 120)",
        "headrace: fraud-scores[1]@4: skipped, a tombstone (no value)",
        "headrace: skipped 2 record(s) that did not decode",
    ]


# --- the control topics: deploying before any worker ran --------------------------------


class FakeBroker:
    """A broker without topic auto-creation: a record for a topic it lacks is never
    delivered (the producer's flush times out)."""

    def __init__(self, topics: set[str]) -> None:
        self.topics = set(topics)
        self.written: list[tuple[str, bytes]] = []

    def ensure_topics(self, bootstrap, partitions, timeout_s=5.0, config=None) -> list[str]:
        created = [name for name in partitions if name not in self.topics]
        self.topics.update(created)
        return created

    def producer(self, settings: dict):
        broker, pending = self, []

        class FakeProducer:
            def produce(self, topic, value, key, on_delivery=None) -> None:
                pending.append((topic, value))

            def flush(self, timeout_s: float) -> int:
                broker.written += [(t, v) for t, v in pending if t in broker.topics]
                return sum(1 for topic, _ in pending if topic not in broker.topics)

            # A deploy writes in a transaction (`change_desired`): its commit is a flush.
            def init_transactions(self, timeout_s: float) -> None:
                pass

            def begin_transaction(self) -> None:
                pass

            def commit_transaction(self, timeout_s: float) -> None:
                if self.flush(timeout_s):
                    raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

            def abort_transaction(self, timeout_s: float) -> None:
                pass

        return FakeProducer()


@pytest.fixture
def fresh_broker(monkeypatch) -> FakeBroker:
    """A broker with the pipelines' topics only: no worker ever ran."""
    import streams.control
    from tools import rollout

    broker = FakeBroker({"transactions", "fraud-scores"})
    monkeypatch.setattr(cli, "_broker_topics", lambda config: dict.fromkeys(broker.topics))
    monkeypatch.setattr(streams.control, "ensure_topics", broker.ensure_topics)
    monkeypatch.setattr(streams.control, "Producer", broker.producer)
    monkeypatch.setattr(rollout, "desired_states", lambda config: {})
    return broker


def test_a_deploy_before_any_worker_ran_creates_the_control_topics(
    monkeypatch, capsys, config_path, fresh_broker
):
    from types import SimpleNamespace

    from tools import rollout

    monkeypatch.setattr(rollout, "resolve_model", lambda model: SimpleNamespace(version="2"))
    code, out, err = run(monkeypatch, capsys, "models", "deploy", "-c", str(config_path),
                         "fraud", "2")  # fmt: skip
    assert (code, out, err) == (0, ["fraud: serving 2 [revision 1, deploy]"], [])
    assert [topic for topic, _ in fresh_broker.written] == ["headrace-control"]


def test_topics_create_creates_the_control_topics_too(
    monkeypatch, capsys, config_path, fresh_broker
):
    import streams.app

    monkeypatch.setattr(streams.app, "create_topics", lambda config, partitions: ["fraud-dlq"])
    code, out, err = run(monkeypatch, capsys, "topics", "create", "-c", str(config_path))
    assert (code, err) == (0, [])
    assert out == ["created: fraud-dlq, headrace-control, headrace-control-status"]
    assert {"headrace-control", "headrace-control-status"} <= fresh_broker.topics


# --- init --------------------------------------------------------------------------------


def test_init_with_a_feature_service_the_repo_lacks_names_it(monkeypatch, capsys, tmp_path):
    """A repo whose registry was never applied has no feature service at all."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "feature_store.yaml").write_text(
        (Path(__file__).parents[2] / "features/repo/feature_store.yaml").read_text()
    )
    code, out, err = run(monkeypatch, capsys, "init", "--name", "x",
                         "--schema", "schemas/transaction.avsc", "--model", "m.onnx",
                         "--feature-service", "fraud_scorng", "--repo", str(repo))  # fmt: skip
    assert (code, out) == (2, [])
    assert err == [
        f"headrace: --feature-service 'fraud_scorng': no such feature service in {repo} "
        "(it has: none); hint: `headrace features prepare` for the sample repo, or "
        "`feast apply` in your own"
    ]


# --- the config file -------------------------------------------------------------------


def test_a_config_that_is_not_utf8_is_named_with_exit_2(monkeypatch, capsys, tmp_path):
    path = tmp_path / "headrace.yaml"
    path.write_bytes("app_id: caf\u00e9\n".encode("latin-1"))
    code, out, err = run(monkeypatch, capsys, "check", "-c", str(path))
    assert (code, out) == (2, [])
    assert err == [
        f"headrace: {path}: not UTF-8 text (byte 0xe9 at offset 11); hint: save the config as UTF-8"
    ]


# --- features prepare --------------------------------------------------------------------


def test_preparing_on_a_redis_that_does_not_answer_names_it_and_keeps_the_repo(
    monkeypatch, capsys, config_path, tmp_path
):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "feature_store.yaml").write_text("online_store: {type: sqlite}\n")
    code, _out, err = run(
        monkeypatch, capsys, "features", "prepare", "-c", str(config_path),
        "--redis", f"127.0.0.1:{free_port()}",
    )  # fmt: skip
    assert code == 69
    assert len(err) == 1 and "does not answer" in err[0] and "headrace redis start" in err[0]
    assert (repo / "feature_store.yaml").read_text() == "online_store: {type: sqlite}\n"


# --- top ---------------------------------------------------------------------------------


def test_top_once_with_no_worker_answering_fails_for_scripts(monkeypatch, capsys, config_path):
    target = f"127.0.0.1:{free_port()}"
    code, out, err = run(
        monkeypatch, capsys, "top", "-c", str(config_path), "--once", "--interval", "0.1",
        "--target", target,
    )  # fmt: skip
    assert code == 69
    assert any(line.startswith(f"unreachable: http://{target}") for line in out)
    assert len(err) == 1 and "no worker's /metrics answered" in err[0]


@pytest.mark.parametrize("option", ["--rate", "--duration"])
def test_produce_refuses_a_rate_or_duration_that_sends_nothing(
    monkeypatch, capsys, config_path, option
):
    code, _out, err = run(monkeypatch, capsys, "produce", "-c", str(config_path), option, "-5")
    assert code == 2
    assert any(option in line for line in err)
