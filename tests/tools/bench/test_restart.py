"""The restart benchmark against a real broker: a worker with commits restarted, every
event of the load after it is ready answered, with figures."""

from __future__ import annotations

import pytest

from tools.bench.restart import restart_run

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_a_restarted_worker_answers_the_load_and_the_figures_say_so(kafka, tmp_path):
    result = restart_run(kafka.bootstrap_servers, "bare", rate=50, seconds=1, state=tmp_path)

    assert result.sent == 50 and result.answered == 50
    assert sum(result.statuses.values()) == 50
    assert result.ready_s > 0 and len(result.arrivals_ms) == 50
    assert "50 answers" in result.lines()
