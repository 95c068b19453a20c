import gc

import pytest
from prometheus_client import REGISTRY

from streams import heap


@pytest.fixture
def restored_collector():
    yield
    gc.unfreeze()
    if heap._observe_pause in gc.callbacks:
        gc.callbacks.remove(heap._observe_pause)


def full_pauses() -> float:
    count = REGISTRY.get_sample_value("headrace_gc_pause_seconds_count", {"generation": "2"})
    return count or 0.0


def test_settled_heap_is_out_of_the_collectors_sight_and_pauses_are_measured(restored_collector):
    survivors = [{"n": n} for n in range(10_000)]  # start-up state that lives on
    heap.settle_heap()
    assert gc.get_freeze_count() >= len(survivors)
    before = full_pauses()
    gc.collect()
    assert full_pauses() == before + 1
