"""A worker frozen past its session (SIGSTOP: a stalled VM, a swap storm) loses its
partitions to the rest of the group; when it runs again, it says the group dropped it,
and what it answers that the new owner answered already is marked
`headrace.redelivered`, and comes second.

Except what it had handed to its Kafka client just before it froze, not sent yet: the
client sends that as soon as the process runs again, before the worker can notice the
freeze (README, "Reading answers"). Such a repeat was produced before the answer it follows
(the record's CreateTime), which tells it apart from a check that missed an answer."""

from __future__ import annotations

import signal
import time

import pytest

from tests.chaos.test_failover import all_answered, answered, repeats_marked, steady_load
from tests.helpers import wait_until
from tests.streams.test_worker import collector_for
from tools.deploy import group_spread, stop_worker

pytestmark = pytest.mark.integration

DROPPED = "the consumer group dropped this worker (its session lapsed)"


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_what_a_worker_frozen_past_its_session_answers_again_is_marked(
    chaos_deploy, kafka, sample_assets, runtime
):
    deployment = chaos_deploy(runtime)
    topic = deployment.spec.input_topic
    group = deployment.config.app_id
    frozen_s = deployment.config.broker.session_timeout_ms / 1000 + 4
    collector = collector_for(deployment)
    try:
        with deployment.worker():
            zombie = deployment.start()
            with steady_load(kafka, deployment, sample_assets.world):
                assert wait_until(
                    lambda: len(group_spread(kafka.bootstrap_servers, group)) == 2, 120
                ), deployment.log_tail()
                assert wait_until(lambda: answered(collector) > 300, 120), deployment.log_tail()
                zombie.send_signal(signal.SIGSTOP)
                time.sleep(frozen_s)  # the fault itself: frozen past the session timeout
                zombie.send_signal(signal.SIGCONT)
                # It finds out at its next heartbeat, and says it is not ready until it
                # rejoins (a readiness probe would catch only that short window).
                assert wait_until(
                    lambda: DROPPED in deployment.log_file.read_text(errors="replace"), 30
                ), deployment.log_tail()
                now = answered(collector)
                assert wait_until(lambda: answered(collector) > now + 300, 60)
            assert wait_until(
                lambda: all_answered(collector, kafka.bootstrap_servers, topic), 60
            ), deployment.log_tail()
            assert stop_worker(zombie) == 0, deployment.log_tail()
        answers = collector.snapshot().predictions
    finally:
        collector.stop()
    print(f"{runtime}: frozen {frozen_s:.0f} s")
    repeats_marked(answers, excused=sent_late)


def sent_late(first: dict, repeat: dict) -> bool:
    """Produced before the answer it follows: it waited in the frozen worker's client."""
    return repeat["produced_ms"] < first["produced_ms"] and not repeat["redelivered"]
