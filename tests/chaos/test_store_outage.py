"""A feature-store outage degrades the answers (the fallback model needs no store) and
never stops the worker; full answers resume when the store is back."""

from __future__ import annotations

import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from features.sample_data import SampleWorld
from infra.ports import free_port
from infra.redis import RedisServer
from tests.helpers import produce_events, scrape, total, wait_until
from tests.streams.test_worker import collector_for
from tools.deploy import prepare_sample_store

pytestmark = pytest.mark.integration

BUDGET_MS = 1_000  # reads may take half of it before their events answer without the store
CACHE_AGE_S = 8.0


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


def check_outage_degrades(
    deployment, kafka, world, outage, outage_s: float, metrics_port: int | None = None
) -> None:
    """Through an outage of `outage_s`, events sent in tens are each answered within
    seconds, as DEGRADED by the fallback model (or OK from features cached before), and
    the worker never exits; full answers resume after it. With `metrics_port`, the
    breaker's state gauge says open or probing during it and closed after."""

    def breaker_state() -> float:
        samples = scrape(metrics_port)
        return total(samples, "headrace_feature_store_state", service=spec.feature_service)

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
                outage_ends, during, batch = time.monotonic() + outage_s, {}, 0
                while time.monotonic() < outage_ends:  # answers flow all through it
                    prefix = f"during{batch}-"
                    during.update(send(10, 200 + batch, prefix))
                    assert wait_until(lambda p=prefix: len(answers_of(collector, p)) == 10, 30), (
                        deployment.log_tail()
                    )
                    batch += 1
                answers = answers_of(collector, "during")
                assert worker.poll() is None
                if metrics_port is not None:
                    assert breaker_state() in (1, 2)  # open, or probing the store
            degraded = [a for a in answers if a["status"] == "DEGRADED"]
            # Events whose features were cached before the outage may still be answered OK.
            assert {a["status"] for a in answers} <= {"OK", "DEGRADED"}, (
                Counter((a["status"], a["reason"]) for a in answers),
                deployment.log_tail(),
            )
            assert len(degraded) >= 0.8 * len(answers), [a["status"] for a in answers]
            assert {(a["degraded_by"], a["reason"]) for a in degraded} == {
                ("fallback_model", "store_unavailable")
            }
            assert sorted(a["event_id"] for a in answers) == sorted(during)
            # Back: a probe finds the store within a second or so; full answers resume.
            assert wait_until(lambda: answered_in_full("after"), 60, 1.0), deployment.log_tail()
            assert worker.poll() is None
            if metrics_port is not None:
                assert wait_until(lambda: breaker_state() == 0, 30)  # closed: reading again
    finally:
        collector.stop()
    assert "store unavailable" in deployment.log_file.read_text()


def test_a_locked_sqlite_store_degrades_then_recovers(deploy, kafka, sample_assets):
    # Views read per key (kept whole, they would answer from memory: the next test).
    port = free_port()
    deployment = deploy(latency_budget_ms=BUDGET_MS, metrics_port=port,
                        feature_cache={"whole_view_max_entities": 0})  # fmt: skip
    check_outage_degrades(
        deployment, kafka, sample_assets.world, lambda: sqlite_locked(sample_assets.repo), 10.0,
        metrics_port=port,
    )  # fmt: skip


def test_views_kept_whole_answer_in_full_through_a_short_store_outage(deploy, kafka, sample_assets):
    """Within `max_staleness_s` of their last check, views kept whole need no store: they
    hold every stored entity, so even the sample's unknown entities (2%) need no read."""
    deployment = deploy(latency_budget_ms=BUDGET_MS)
    spec = deployment.spec
    collector = collector_for(deployment)
    try:
        with deployment.worker() as worker:
            produce_events(kafka.bootstrap_servers, spec.input_topic, sample_assets.world, 5,
                           seed=31, prefix="warm-")  # fmt: skip
            assert wait_until(lambda: len(answers_of(collector, "warm-")) == 5, 120), (
                deployment.log_tail()
            )
            with sqlite_locked(sample_assets.repo):
                during = produce_events(
                    kafka.bootstrap_servers, spec.input_topic, sample_assets.world, 100,
                    seed=32, prefix="during-",
                )  # fmt: skip
                assert wait_until(lambda: len(answers_of(collector, "during-")) == 100, 60), (
                    deployment.log_tail()
                )
            answers = answers_of(collector, "during-")
            assert worker.poll() is None
    finally:
        collector.stop()
    statuses = Counter(a["status"] for a in answers)
    reasons = Counter((a["status"], a["reason"]) for a in answers)
    assert set(statuses) <= {"OK", "DEGRADED"}, reasons
    assert statuses["OK"] >= 95, reasons
    assert sorted(a["event_id"] for a in answers) == sorted(during)


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_a_stopped_redis_degrades_then_recovers(deploy, kafka, tmp_path, runtime):
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
        deployment = deploy(repo_path=repo, runtime=runtime, latency_budget_ms=BUDGET_MS)
        check_outage_degrades(deployment, kafka, world, stopped, 20.0)
    finally:
        server.stop()


def test_a_worker_started_while_its_redis_is_down_degrades_then_answers_in_full(
    deploy, kafka, tmp_path
):
    """The store down before the worker starts: the start does not fail, events are
    answered DEGRADED by the fallback model, and in full once the store is back."""
    server = RedisServer(tmp_path / "redis", free_port())
    server.start()
    world = SampleWorld()
    repo = tmp_path / "repo"
    prepare_sample_store(repo, world, redis=server.connection_string)
    server.stop()
    deployment = deploy(repo_path=repo, runtime="bare", latency_budget_ms=BUDGET_MS)
    spec = deployment.spec
    collector = collector_for(deployment)
    sent = iter(range(1_000))

    def answered_in_full() -> bool:
        seed = next(sent)
        produce_events(kafka.bootstrap_servers, spec.input_topic, world, 5, seed=seed,
                       prefix=f"after{seed}-")  # fmt: skip
        return any(p["status"] == "OK" for p in answers_of(collector, "after"))

    try:
        with deployment.worker() as worker:
            # Serving once one event is answered (sent while it starts, it may be past
            # its budget: shed). Then every event is answered without the store.
            produce_events(kafka.bootstrap_servers, spec.input_topic, world, 1, seed=6,
                           prefix="first-")  # fmt: skip
            assert wait_until(lambda: answers_of(collector, "first-"), 120), deployment.log_tail()
            produce_events(kafka.bootstrap_servers, spec.input_topic, world, 20, seed=7,
                           prefix="down-")  # fmt: skip
            assert wait_until(lambda: len(answers_of(collector, "down-")) == 20, 60)
            reasons = Counter((a["status"], a["reason"]) for a in answers_of(collector, "down-"))
            assert reasons == {("DEGRADED", "store_unavailable"): 20}, deployment.log_tail()
            server.start()  # empty (no persistence): answers are OK with missing features
            assert wait_until(answered_in_full, 60, 1.0), deployment.log_tail()
            assert worker.poll() is None
    finally:
        collector.stop()
        server.stop()


def test_without_a_fallback_model_the_answer_cache_repeats_recent_answers_up_to_max_age(
    deploy, kafka, sample_assets
):
    """The answer cache is then the first rung: during a store outage, an input identical
    to one answered in full at most `max_age_s` ago gets that answer again, DEGRADED by
    `cache`; after `max_age_s` the same input is shed. (The feature cache is off: it
    would answer the same inputs' features without the store.)"""
    deployment = deploy(latency_budget_ms=BUDGET_MS, fallback_model=None,
                        answer_cache={"max_age_s": CACHE_AGE_S},
                        feature_cache={"max_entries": 0})  # fmt: skip
    collector = collector_for(deployment)

    def send(prefix: str, seed: int = 21) -> dict:
        # The same seed makes the same inputs (entity keys, amounts, ...), new event ids.
        return produce_events(kafka.bootstrap_servers, deployment.spec.input_topic,
                              sample_assets.world, 20, seed=seed, prefix=prefix)  # fmt: skip

    def answered(prefix: str) -> dict[str, dict]:
        """Answers of `prefix` once all 20 are in, by the event's index."""
        assert wait_until(lambda: len(answers_of(collector, f"{prefix}-")) == 20, 60), (
            deployment.log_tail()
        )
        return {a["event_id"].rsplit("-", 1)[1]: a for a in answers_of(collector, f"{prefix}-")}

    tries = iter(range(1000, 2000))

    def answers_in_full() -> bool:
        attempt = next(tries)
        send(f"warm{attempt}", seed=attempt)
        return any(p["status"] == "OK" for p in answers_of(collector, "warm"))

    try:
        with deployment.worker() as worker:
            assert wait_until(answers_in_full, 120, 1.0), deployment.log_tail()
            send("first")
            first = answered("first")
            cached_by_s = time.monotonic() + CACHE_AGE_S  # the answers were cached before
            assert {a["status"] for a in first.values()} == {"OK"}
            with sqlite_locked(sample_assets.repo):
                send("again")
                again = answered("again")
                assert time.monotonic() < cached_by_s, "too slow to test the cache's age"
                assert {(a["status"], a["degraded_by"], a["reason"]) for a in again.values()} == {
                    ("DEGRADED", "cache", "store_unavailable")
                }
                assert {i: a["score"] for i, a in again.items()} == {
                    i: a["score"] for i, a in first.items()
                }
                # The cache's age is what is under test here: let it pass.
                time.sleep(max(0.0, cached_by_s + 0.5 - time.monotonic()))
                send("late")
                late = answered("late")
                assert {(a["status"], a["reason"]) for a in late.values()} == {
                    ("SHED", "store_unavailable")
                }
            assert wait_until(answers_in_full, 60, 1.0), deployment.log_tail()
            assert worker.poll() is None
    finally:
        collector.stop()
