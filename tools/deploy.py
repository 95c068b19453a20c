"""Deploying headrace locally for the demo, the benchmarks and the tests: the sample
pipeline's config, its assets (Feast store, models), and worker processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from features.sample_data import SampleWorld
from features.store import prepare_sample_store
from models.train import fallback_path
from schemas.catalogue import SCHEMA_DIR
from streams.config import HeadraceConfig, parse_config
from streams.health import READY_PATH

# The sample fraud pipeline's events and the checks they must pass (headrace.yaml's).
FRAUD_INPUT: dict[str, Any] = {
    "schema": str(SCHEMA_DIR / "transaction.avsc"),
    "event_id_field": "event_id",
    "validate": {
        "event_id": ["non_empty"],
        "user_id": ["non_empty"],
        "merchant_id": ["non_empty"],
        "amount": {"finite": True, "min": 0},
        "hour_of_day": {"min": 0, "max": 23},
    },
}


def clicks_pipeline(suffix: str, model_path: Path, defaults: dict[str, float]) -> dict[str, Any]:
    """The second example: click events, a product view in Feast, a multiclass skl2onnx
    model without headrace metadata, described here column by column."""
    from features.sample_data import PAGE_TYPES, PRODUCT_FEATURES

    stats = [f"product_stats__{name}" for name in PRODUCT_FEATURES]
    return {
        "name": "clicks",
        "input_topic": f"clicks{suffix}",
        "output_topic": f"click-intents{suffix}",
        "dead_letter_topic": f"clicks-dlq{suffix}",
        "input": {
            "schema": str(SCHEMA_DIR / "click.avsc"),
            "event_id_field": "event_id",
            "validate": {
                "event_id": ["non_empty"],
                "session_id": ["non_empty"],
                "product_id": ["non_empty"],
                "page_type": {"one_of": list(PAGE_TYPES)},
                "dwell_ms": {"min": 0},
            },
        },
        "feature_service": "click_intent",
        "entity_fields": {"product_id": "product_id"},
        "model": {
            "path": str(model_path),
            "inputs": [
                {"name": "page_type", "dtype": "string", "columns": ["page_type"]},
                {"name": "dwell_ms", "dtype": "int64", "columns": ["dwell_ms"]},
                *(
                    {"name": ref, "columns": [{"from": ref, "default": defaults[ref]}]}
                    for ref in stats
                ),
            ],
            "output": {"task": "multiclass", "tensor": "output_probability", "top_k": 3},
        },
        "output": {"include": ["event_id", "session_id"], "record_name": "IntentPrediction"},
    }


def sample_config(
    bootstrap_servers: str,
    repo_path: Path,
    model_path: Path,
    *,
    suffix: str = "",
    registry_url: str | None = None,
    metrics_port: int = 0,
    max_batch_size: int = 64,
    max_wait_ms: float = 2.0,
    latency_budget_ms: float = 100.0,
    runtime: str = "faust",
    max_in_flight: int = 2_000,
    fallback_model: Path | None = None,
    default_score: float | None = None,
    answer_cache: dict[str, Any] | None = None,
    feature_cache: dict[str, Any] | None = None,
    priority: dict[str, Any] | None = None,
    clicks_model: Path | None = None,
    delivery: str = "at_least_once",
    instance_id: str | None = None,
    tracing: dict[str, Any] | None = None,
    log_format: str = "text",
    broker: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The sample fraud pipeline's config as a plain dict (what a YAML file would hold),
    with the click-intent pipeline beside it when `clicks_model` is given.

    Without `fallback_model` and `default_score` the ladder has only the answer cache
    above shedding."""
    config: dict[str, Any] = {
        "app_id": f"headrace{suffix}",
        "runtime": runtime,
        "delivery": delivery,
        "broker": {"bootstrap_servers": bootstrap_servers, **(broker or {})},
        "features": {"repo_path": str(repo_path)},
        "metrics": {"port": metrics_port},
        "pipelines": [
            {
                "name": "fraud",
                "input_topic": f"transactions{suffix}",
                "output_topic": f"fraud-scores{suffix}",
                "dead_letter_topic": f"transactions-dlq{suffix}",
                "input": FRAUD_INPUT,
                "feature_service": "fraud_scoring",
                "entity_fields": {"user_id": "user_id", "merchant_id": "merchant_id"},
                "model": {"path": str(model_path)},
                "latency_budget_ms": latency_budget_ms,
                "max_in_flight": max_in_flight,
                "max_batch_size": max_batch_size,
                "max_wait_ms": max_wait_ms,
                "priority": priority or {},
                "feature_cache": feature_cache or {},
                "degradation": {
                    "fallback_model": {"path": str(fallback_model)} if fallback_model else None,
                    "default_score": default_score,
                    "answer_cache": answer_cache or {},
                },
            }
        ],
    }
    if clicks_model is not None:
        clicks = clicks_pipeline(suffix, clicks_model, intent_defaults())
        shared = ("latency_budget_ms", "max_in_flight", "max_batch_size", "max_wait_ms")
        clicks.update({key: config["pipelines"][0][key] for key in shared})
        config["pipelines"].append(clicks)
    if registry_url:
        config["registry"] = {"url": registry_url}
    if instance_id is not None:
        config["broker"]["instance_id"] = instance_id
    if tracing is not None:
        config["tracing"] = tracing
    if log_format != "text":
        config["log_format"] = log_format
    return config


def intent_defaults() -> dict[str, float]:
    """The click-intent model's value for each product feature of a missing product."""
    from models.train_intent import INTENT_DEFAULTS

    return INTENT_DEFAULTS


def prepare_sample_assets(state_dir: Path, world: SampleWorld) -> tuple[Path, Path]:
    """Feast repo with materialized features and the trained models (the full one,
    returned, its fallback and the click-intent model beside it) under `state_dir`.
    Models already there are kept."""
    from models.train import train
    from models.train_intent import intent_path, train_intent

    repo = state_dir / "features"
    prepare_sample_store(repo, world)
    model = state_dir / "models" / "fraud-mlp.onnx"
    if not model.exists() or not fallback_path(model).exists():
        train(model, world)
    if not intent_path(model).exists():
        train_intent(intent_path(model), world)
    return repo, model


def start_worker(config_file: Path, log_file: Path, log_level: str = "warn") -> subprocess.Popen:
    return start_process(
        ["-m", "tools.cli", "worker", "-c", str(config_file), "-l", log_level], log_file
    )


def wait_until_ready(worker: subprocess.Popen, port: int, timeout_s: float) -> bool:
    """Whether the worker answered ready on its metrics port (`/healthz/ready`: models
    warmed, partitions assigned) within `timeout_s`; False at once if it exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and worker.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{READY_PATH}", timeout=1):
                return True
        except OSError:  # not listening yet, or 503: not ready yet
            time.sleep(0.05)
    return False


def start_process(arguments: list[str], log_file: Path) -> subprocess.Popen:
    """A Python child process logging to `log_file`, without Feast's metrics variables."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")}
    with open(log_file, "ab") as log:
        return subprocess.Popen(
            [sys.executable, *arguments],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment,
        )


def stop_worker(worker: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM (a clean stop that commits), SIGKILL if it does not end in time."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout_s)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return worker.returncode


def group_spread(bootstrap: str, group: str, timeout_s: float = 15.0) -> list[int]:
    """How many partitions each member of consumer group `group` holds, members without
    any left out, largest first; empty while the group has no member or its coordinator
    is still loading (a fresh broker), so a caller asks again."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    (future,) = admin.describe_consumer_groups([group], request_timeout=timeout_s).values()
    try:
        described = future.result(timeout=timeout_s + 5)
    except KafkaException:
        return []
    held = (len(member.assignment.topic_partitions) for member in described.members)
    return sorted((count for count in held if count), reverse=True)


def write_config(config: dict[str, Any], path: Path) -> HeadraceConfig:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return parse_config(config, str(path), path.parent)
