"""The MLServer baseline as a system of `headrace bench`: its settings, its process,
its events and the reader of its answers.

MLServer runs in its own environment (`env.py`) as one process, `serve.py` over a
model folder this module writes: `settings.json` (Kafka mode on the bench's topics,
inference inline: `parallel_workers: 0`, debug logging off and MLServer's loggers at
WARNING, as headrace's workers run) and `model-settings.json` (the custom runtime,
adaptive batching up to the bench's batch size within `max_batch_time_ms`, and what
the runtime must know of the pipeline: feature repo and service, entity fields,
model file, columns with their defaults, output tensor, threshold).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from confluent_kafka import Message

from infra.ports import free_port
from models.config import ModelConfig
from models.session import load_session, signature_of
from tools.bench.latency import LatencyLog
from tools.bench.mlserver import v2
from tools.bench.mlserver.env import MLServerUnavailable
from tools.collector import TopicReader

REPO_ROOT = Path(__file__).resolve().parents[3]
RUNTIME = "tools.bench.mlserver.runtime.FraudRuntime"
READY_TIMEOUT_S = 240.0
_HTTP_TIMEOUT_S = 2.0


def write_model_folder(
    folder: Path,
    *,
    bootstrap: str,
    input_topic: str,
    output_topic: str,
    repo_path: Path,
    feature_service: str,
    entity_fields: dict[str, str],
    model_path: Path,
    max_batch_size: int,
    max_batch_time_ms: float,
    freeze_heap: bool,
) -> int:
    """MLServer's settings for the sample fraud pipeline in `folder`; returns the HTTP
    port its readiness is asked on."""
    config = ModelConfig(path=model_path)
    signature = signature_of(config, load_session(config))
    (tensor,) = signature.inputs
    http_port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        "debug": False,
        "parallel_workers": 0,
        "host": "127.0.0.1",
        "http_port": http_port,
        "grpc_port": free_port(),
        "metrics_port": free_port(),
        "kafka_enabled": True,
        "kafka_servers": bootstrap,
        "kafka_topic_input": input_topic,
        "kafka_topic_output": output_topic,
        # Without handlers of its own the logger keeps WARNING and above (to stderr).
        "logging_settings": {
            "version": 1,
            "disable_existing_loggers": False,
            "loggers": {"mlserver": {"level": "WARNING"}},
        },
    }
    model_settings = {
        "name": v2.MODEL_NAME,
        "implementation": RUNTIME,
        "max_batch_size": max_batch_size,
        "max_batch_time": max_batch_time_ms / 1000,
        "parameters": {
            "extra": {
                "repo_path": str(repo_path),
                "feature_service": feature_service,
                "entity_fields": entity_fields,
                "model_path": str(model_path),
                "input": tensor.name,
                "columns": [{"source": c.source, "default": c.default} for c in tensor.columns],
                "output": signature.output.tensor,
                "threshold": signature.output.threshold,
                "intra_op_threads": config.intra_op_threads,
                "freeze_heap": freeze_heap,
            }
        },
    }
    (folder / "settings.json").write_text(json.dumps(settings, indent=2))
    (folder / "model-settings.json").write_text(json.dumps(model_settings, indent=2))
    return http_port


def start(python: Path, folder: Path, log_file: Path) -> subprocess.Popen:
    """MLServer over `folder`, one process (its pid is what the CPU meter reads)."""
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("PROMETHEUS_MULTIPROC", "PYTHONPATH"))}  # fmt: skip
    # The runtime and the shims are imported from this checkout.
    environment["PYTHONPATH"] = str(REPO_ROOT)
    with open(log_file, "ab") as log:
        return subprocess.Popen(
            [str(python), "-m", "tools.bench.mlserver.serve", str(folder)],
            cwd=folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment,
        )


def wait_ready(process: subprocess.Popen, http_port: int, log_file: Path) -> None:
    """Block until MLServer says the model is ready (its Kafka consumer may already run:
    records read before the model loads would fail). MLServerUnavailable if it exits or
    is not ready within READY_TIMEOUT_S."""
    url = f"http://127.0.0.1:{http_port}/v2/models/{v2.MODEL_NAME}/ready"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise MLServerUnavailable(
                f"MLServer exited with {process.returncode} while starting; see {log_file}"
            )
        try:
            with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise MLServerUnavailable(
        f"MLServer's model was not ready within {READY_TIMEOUT_S:.0f} s; see {log_file}"
    )


def records(events: Iterator[dict[str, Any]], key_field: str = "user_id") -> Iterator[v2.Record]:
    """The bench's events as MLServer Kafka records, keyed like headrace's inputs."""
    for event in events:
        yield v2.record(event[key_field].encode(), event)


def answer_reader(bootstrap: str, topics: list[str], log: LatencyLog) -> TopicReader:
    """Reads MLServer's V2 answers: latency from the input Kafka timestamp they carry,
    as the bench's prediction reader does for headrace. An answer that cannot be read
    is counted as read (the step does not wait for it) and logged as nothing, so its
    event counts as unanswered."""

    def keep(messages: list[Message], read_ms: float) -> int:
        for message in messages:
            try:
                answer = v2.read_answer(message.value())
            except v2.V2Error:
                continue
            log.add(answer.timestamp_ms, int((read_ms - answer.timestamp_ms) * 1000), "OK")
        return len(messages)

    return TopicReader(bootstrap, topics, keep)
