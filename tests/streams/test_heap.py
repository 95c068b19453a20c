import gc

import pytest
from prometheus_client import REGISTRY

from streams import heap


@pytest.fixture
def restored_collector():
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
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


def test_traffic_in_flight_does_not_set_off_young_collections(restored_collector):
    heap.settle_heap()
    young = []

    def collected(phase: str, info: dict) -> None:
        young.append(info["generation"])

    gc.callbacks.append(collected)
    try:
        in_flight = [{"event": n} for n in range(3_000)]  # a loaded worker's live batches
    finally:
        gc.callbacks.remove(collected)
    assert len(in_flight) == 3_000
    assert young == []  # CPython's default threshold (700) ran four young collections
