"""A feature-store outage degrades the answers (the fallback model needs no store) and
never stops the worker; full answers resume when the store is back."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from features.sample_data import SampleWorld
from infra.ports import free_port
from infra.redis import RedisServer
from tests.helpers import produce_events, wait_until
from tests.streams.test_worker import collector_for
from tools.deploy import prepare_sample_store

pytestmark = pytest.mark.integration

BUDGET_MS = 1_000  # reads may take half of it before their events answer without the store


@contextmanager
def sqlite_locked(repo) -> Iterator[None]:
    """An exclusive lock on the SQLite online store: every read blocks, then fails."""
    lock = sqlite3.connect(repo / "data" / "online_store.db", isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        yield
    finally:
        lock.execute("ROLLBACK")
        lock.close()


def answers_of(collector, prefix: str) -> list[dict]:
    return [p for p in collector.snapshot().predictions if p["event_id"].startswith(prefix)]


def check_outage_degrades(deployment, kafka, world, outage) -> None:
    spec = deployment.spec
    collector = collector_for(deployment)

    def send(count: int, seed: int, prefix: str) -> dict:
        return produce_events(kafka.bootstrap_servers, spec.input_topic, world, count,
                              seed=seed, prefix=prefix)  # fmt: skip

    seed = 100

    def answered_in_full(prefix: str) -> bool:
        """Send a few more events; whether any event of `prefix` was answered OK."""
        nonlocal seed
        seed += 1
        send(5, seed, f"{prefix}{seed}-")
        return any(p["status"] == "OK" for p in answers_of(collector, prefix))

    try:
        with deployment.worker() as worker:
            # Serving: events sent while it starts can be past their 1 s budget.
            assert wait_until(lambda: answered_in_full("warm"), 120, 1.0), deployment.log_tail()
            send(40, 11, "before-")
            assert wait_until(lambda: len(answers_of(collector, "before-")) == 40, 120)
            assert {p["status"] for p in answers_of(collector, "before-")} == {"OK"}
            with outage():
                during = send(100, 12, "during-")
                assert wait_until(lambda: len(answers_of(collector, "during-")) == 100, 60), (
                    deployment.log_tail()
                )
                answers = answers_of(collector, "during-")
                assert worker.poll() is None
            degraded = [a for a in answers if a["status"] == "DEGRADED"]
            # Events whose features were cached before the outage may still be answered OK.
            assert {a["status"] for a in answers} <= {"OK", "DEGRADED"}
            assert len(degraded) >= 80, [a["status"] for a in answers]
            assert {(a["degraded_by"], a["reason"]) for a in degraded} == {
                ("fallback_model", "store_unavailable")
            }
            assert sorted(a["event_id"] for a in answers) == sorted(during)
            # Back: a probe finds the store within a second or so; full answers resume.
            assert wait_until(lambda: answered_in_full("after"), 60, 1.0), deployment.log_tail()
            assert worker.poll() is None
    finally:
        collector.stop()
    assert "store unavailable" in deployment.log_file.read_text()


def test_a_locked_sqlite_store_degrades_then_recovers(deploy, kafka, sample_assets):
    deployment = deploy(latency_budget_ms=BUDGET_MS)
    check_outage_degrades(
        deployment, kafka, sample_assets.world, lambda: sqlite_locked(sample_assets.repo)
    )


def test_a_stopped_redis_degrades_then_recovers(deploy, kafka, tmp_path):
    server = RedisServer(tmp_path / "redis", free_port())
    server.start()
    world = SampleWorld()
    repo = tmp_path / "repo"
    prepare_sample_store(repo, world, redis=server.connection_string)

    @contextmanager
    def stopped() -> Iterator[None]:
        server.stop()
        try:
            yield
        finally:
            server.start()  # empty (no persistence): answers are OK with missing features

    try:
        deployment = deploy(repo_path=repo, runtime="bare", latency_budget_ms=BUDGET_MS)
        check_outage_degrades(deployment, kafka, world, stopped)
    finally:
        server.stop()
