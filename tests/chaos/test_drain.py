"""SIGTERM under load: the worker drains, commits and leaves within `drain_timeout_s`,
and the worker started after it answers the rest: nothing lost, nothing repeated."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.chaos.conftest import outcomes_per_input
from tests.chaos.test_failover import all_answered, answered, steady_load
from tests.helpers import wait_until
from tests.streams.test_worker import collector_for
from tools.deploy import stop_worker

pytestmark = pytest.mark.integration

RATE_PER_S = 200


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_a_worker_stopped_under_load_drains_in_time_and_nothing_is_lost_or_repeated(
    chaos_deploy, kafka, sample_assets, runtime
):
    deployment = chaos_deploy(runtime)
    topic = deployment.spec.input_topic
    deadline_s = deployment.config.drain_timeout_s
    collector = collector_for(deployment)
    try:
        with steady_load(kafka, deployment, sample_assets.world, per_s=RATE_PER_S):
            # At log level info: the worker logs its drain time.
            worker = deployment.start(log_level="info")
            assert wait_until(lambda: answered(collector) > 300, 120), deployment.log_tail()
            stopped_at = time.monotonic()
            worker.send_signal(signal.SIGTERM)
            code = worker.wait(deadline_s + 15)
            exit_s = time.monotonic() - stopped_at
            assert code == 0, deployment.log_tail()
            restarted = deployment.start()
            now = answered(collector)
            assert wait_until(lambda: answered(collector) > now + 100, 60)
        assert wait_until(lambda: all_answered(collector, kafka.bootstrap_servers, topic), 60), (
            deployment.log_tail()
        )
        assert stop_worker(restarted) == 0
        counts = outcomes_per_input(collector.snapshot(), topic)
        repeated = {where: n for where, n in counts.items() if n > 1}
        drained = re.search(r"drained and left the group in ([\d.]+) s", deployment.log_tail(400))
        print(f"{runtime}: SIGTERM at {RATE_PER_S}/s -> exit in {exit_s:.2f} s (drained and "
              f"left the group in {drained and drained[1]} s); {len(counts)} inputs, "
              f"{len(repeated)} repeated")  # fmt: skip
        assert exit_s < deadline_s
        assert not repeated, f"{len(repeated)} inputs answered more than once"
    finally:
        collector.stop()
