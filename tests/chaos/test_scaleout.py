"""Scale-out under a steady load: 1, then 2, then 3 workers of one group over an input
topic of 12 partitions, then back to 1. Each step spreads the partitions evenly (12, 6
and 6, 4 each) and every input is answered exactly once through the joins and leaves."""

from __future__ import annotations

import time

import pytest

from tests.chaos.conftest import outcomes_per_input
from tests.chaos.test_failover import all_answered, answered, steady_load
from tests.helpers import wait_until
from tests.streams.test_worker import collector_for
from tools.deploy import group_spread, stop_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PARTITIONS = 12
RATE_PER_S = 150


def test_workers_joining_and_leaving_under_load_share_the_partitions_evenly_and_answer_once(
    chaos_deploy, kafka, sample_assets
):
    deployment = chaos_deploy("bare", input_partitions=PARTITIONS)
    topic = deployment.spec.input_topic
    group = deployment.config.app_id
    collector = collector_for(deployment)
    workers = []
    seen: list[list[int]] = []

    def spread_becomes(expected: list[int]) -> None:
        def settled() -> bool:
            spread = group_spread(kafka.bootstrap_servers, group)
            if not seen or seen[-1] != spread:
                seen.append(spread)
            return spread == expected

        assert wait_until(settled, 120), f"spread {seen[-1:]} not {expected}; " + (
            deployment.log_tail()
        )
        # Answers keep flowing after each rebalance, whoever holds the partitions.
        now = answered(collector)
        assert wait_until(lambda: answered(collector) > now + RATE_PER_S, 60), deployment.log_tail()

    started = time.monotonic()
    try:
        with steady_load(kafka, deployment, sample_assets.world, per_s=RATE_PER_S):
            for count in (1, 2, 3):
                workers.append(deployment.start())
                spread_becomes([PARTITIONS // count] * count)
            for count in (2, 1):
                assert stop_worker(workers.pop()) == 0, deployment.log_tail()
                spread_becomes([PARTITIONS // count] * count)
        assert wait_until(lambda: all_answered(collector, kafka.bootstrap_servers, topic), 60), (
            deployment.log_tail()
        )
        assert stop_worker(workers.pop()) == 0, deployment.log_tail()
        counts = outcomes_per_input(collector.snapshot(), topic)
        repeated = {where: n for where, n in counts.items() if n > 1}
        print(f"1 -> 2 -> 3 -> 2 -> 1 workers at {RATE_PER_S}/s over {PARTITIONS} partitions "
              f"in {time.monotonic() - started:.0f} s: spreads {seen}; {len(counts)} inputs, "
              f"{len(repeated)} answered more than once")  # fmt: skip
        assert not repeated, f"{len(repeated)} inputs answered more than once"
    finally:
        for worker in workers:
            stop_worker(worker)
        collector.stop()
