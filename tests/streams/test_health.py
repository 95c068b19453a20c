"""`/healthz/live` and `/healthz/ready`: the checks with a fake clock, then a live worker
whose event loop a test blocks, and a feature-store outage that makes it not ready."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from features.breaker import BreakerState
from infra.ports import free_port
from streams.config import parse_config
from streams.health import LIVE_PATH, READY_PATH, Health
from tests.chaos.test_store_outage import sqlite_locked
from tests.helpers import PATIENT_BUDGET_MS, produce_events, wait_until
from tools.deploy import start_process, stop_worker

MINIMAL = {
    "broker": {"bootstrap_servers": "127.0.0.1:1"},
    "health": {"stall_after_s": 10, "loop_timeout_ms": 200},
    "pipelines": [
        {
            "name": "p",
            "input_topic": "in",
            "output_topic": "out",
            "dead_letter_topic": "dlq",
            "input": {"schema": "schemas/transaction.avsc"},
            "model": {"path": "models/artifacts/fraud-mlp.onnx"},
        }
    ],
}


class FakeLookup:
    service = "svc"

    def __init__(self) -> None:
        self.breaker = type("Breaker", (), {"state": BreakerState.CLOSED})()


@pytest.fixture
def running_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def health_with(clock) -> Health:
    return Health(parse_config(MINIMAL, "test"), clock=clock)


def test_live_while_starting_then_stalled_when_records_wait_unanswered(running_loop):
    now = [0.0]
    health = health_with(lambda: now[0])
    assert health.live() == []  # starting: warming models
    waiting = [0]
    health.serving(running_loop, "p", lambda: waiting[0])
    now[0] = 100.0
    assert health.live() == []  # nothing to do is no stall
    waiting[0] = 5
    now[0] = 105.0
    assert health.live() == []
    now[0] = 111.0
    (problem,) = health.live()
    assert problem == "pipeline p: records wait and nothing was answered for 11 s"
    health.answered("p")
    assert health.live() == []


def test_a_stuck_pipeline_is_not_hidden_by_another_that_answers(running_loop, caplog):
    now = [0.0]
    health = health_with(lambda: now[0])
    health.serving(running_loop, "fraud", lambda: 3)  # answers flow
    health.serving(running_loop, "clicks", lambda: 500)  # a hung model run: none
    for second in (5.0, 10.0):
        now[0] = second
        health.answered("fraud")
    assert health.live() == []
    now[0] = 16.0
    health.answered("fraud")
    problems = health.live()
    assert problems == ["pipeline clicks: records wait and nothing was answered for 16 s"]
    assert health.answer(LIVE_PATH) == (503, problems[0] + "\n")
    assert [r.message for r in caplog.records] == [f"not live: {problems[0]}"]  # once
    health.answered("clicks")
    assert health.live() == []


def test_not_live_while_the_event_loop_is_blocked(running_loop):
    health = health_with(time.monotonic)
    health.serving(running_loop, "p", lambda: 0)
    assert health.live() == []
    running_loop.call_soon_threadsafe(time.sleep, 1.0)
    time.sleep(0.05)
    assert health.live() == ["event loop did not answer within 0.2 s"]
    assert wait_until(lambda: health.live() == [], 5, 0.1)


def test_ready_needs_warm_models_a_group_a_closed_breaker_and_no_drain(running_loop):
    health = health_with(time.monotonic)
    health._broker_reachable = lambda: True  # no broker here; tested against a live one
    assert health.ready() == ["starting: models warming up"]
    lookup = FakeLookup()
    health.warmed([lookup])
    health.serving(running_loop, "p", lambda: 0)
    assert health.ready() == ["consumer group not joined yet"]
    health.joined(True)
    assert health.ready() == []
    lookup.breaker.state = BreakerState.OPEN
    assert health.ready() == ["feature store of 'svc' unavailable"]
    lookup.breaker.state = BreakerState.CLOSED
    health.lost_group()  # dropped by the group: not ready until it rejoins
    assert health.ready() == ["consumer group lost this worker (session lapsed); rejoining"]
    health.joined(True)
    assert health.ready() == []
    health.draining()
    assert health.ready() == ["draining: stopping"]
    assert health.answer(READY_PATH) == (503, "draining: stopping\n")
    assert health.answer(LIVE_PATH) == (200, "ok\n")
    assert health.answer("/metrics") is None


def test_a_broker_that_refuses_connections_is_not_ready():
    health = health_with(time.monotonic)
    assert "no broker of 127.0.0.1:1 accepts a connection" in health.ready()


# A live worker whose event loop blocks for BLOCK_S on SIGALRM: a Python signal handler
# runs on the main thread, which runs the event loop in both runtimes. Past the group
# session (6 s): the Faust runtime heartbeats from that loop, so it is stopped while it
# rejoins, which must still end cleanly.
BLOCK_S = 8
WEDGEABLE = (
    "import signal, sys, time\n"
    f"signal.signal(signal.SIGALRM, lambda *_: time.sleep({BLOCK_S}))\n"
    "from tools.cli import main\n"
    "sys.argv[0] = 'headrace'\n"
    "main()\n"
)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:  # not listening yet, or gone
        return 0, str(error)


@pytest.mark.integration
@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_a_live_worker_is_ready_and_not_live_while_its_loop_is_blocked(
    deploy, kafka, sample_assets, runtime
):
    port = free_port()
    deployment = deploy(runtime=runtime, metrics_port=port, latency_budget_ms=PATIENT_BUDGET_MS)
    arguments = ["-c", WEDGEABLE, "worker", "-c", str(deployment.config_file), "-l", "info"]
    worker = start_process(arguments, deployment.log_file)
    try:
        assert wait_until(lambda: get(port, READY_PATH)[0] == 200, 120, 0.5), (
            get(port, READY_PATH) if worker.poll() is None else deployment.log_tail()
        )
        assert get(port, LIVE_PATH) == (200, "ok\n")
        produce_events(kafka.bootstrap_servers, deployment.spec.input_topic,
                       sample_assets.world, 20, seed=1, prefix="h")  # fmt: skip
        worker.send_signal(signal.SIGALRM)
        status, body = get(port, LIVE_PATH)
        assert status == 503 and "event loop did not answer" in body, (status, body)
        assert wait_until(lambda: get(port, LIVE_PATH)[0] == 200, BLOCK_S + 10, 0.5)
        assert worker.poll() is None
    finally:
        assert stop_worker(worker) == 0, deployment.log_tail()


@pytest.mark.integration
def test_a_store_outage_makes_a_live_worker_not_ready_until_it_is_back(
    deploy, kafka, sample_assets
):
    port = free_port()
    # Views read per key: kept whole, they would need no store during the outage.
    deployment = deploy(runtime="bare", metrics_port=port, latency_budget_ms=1_000,
                        feature_cache={"whole_view_max_entities": 0})  # fmt: skip
    topic = deployment.spec.input_topic
    seeds = iter(range(100, 10_000))

    def send() -> None:
        seed = next(seeds)
        produce_events(kafka.bootstrap_servers, topic, sample_assets.world, 10,
                       seed=seed, prefix=f"s{seed}-")  # fmt: skip

    def ready_after_sending() -> bool:
        send()
        return get(port, READY_PATH)[0] == 200

    with deployment.worker():
        assert wait_until(ready_after_sending, 120, 0.5), get(port, READY_PATH)
        with sqlite_locked(sample_assets.repo):
            assert wait_until(lambda: not ready_after_sending(), 30, 0.5)
            status, body = get(port, READY_PATH)
            assert status == 503 and "feature store of 'fraud_scoring' unavailable" in body
            assert get(port, LIVE_PATH)[0] == 200  # degraded answers flow: alive
        assert wait_until(ready_after_sending, 30, 0.5), get(port, READY_PATH)
