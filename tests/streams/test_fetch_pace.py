"""When the Faust runtime's fetches wait at the broker to gather records (`FetchPace`):
only while the input's rate fills a wait with sixteen records or more, near the
worker's limit; below it the wait would be latency."""

from __future__ import annotations

from streams.consumers.faust_feed import PACE_WINDOW_S, FetchPace


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fetch_at_rate(pace: FetchPace, clock: Clock, per_s: float, seconds: float) -> bool:
    """Fetches every millisecond for `seconds`, bringing what `per_s` brings; the mode after."""
    busy, carried = False, 0.0
    for _ in range(round(seconds * 1000)):
        clock.now += 0.001
        carried += per_s / 1000
        count = int(carried)
        carried -= count
        busy = pace.busy(count)
    return busy


def test_light_load_is_answered_on_the_first_byte_and_heavier_load_waits():
    clock = Clock()
    pace = FetchPace(busy_wait_s=0.005, clock=clock)
    # 1,600/s fills a 5 ms wait with eight records: light load, answered at once.
    assert not fetch_at_rate(pace, clock, 1_600, 1.0)
    # 4,000/s fills it with twenty.
    assert fetch_at_rate(pace, clock, 4_000, 1.0)


def test_a_rate_between_the_thresholds_keeps_the_mode_it_has():
    clock = Clock()
    pace = FetchPace(busy_wait_s=0.005, clock=clock)
    # 2,400/s: 12 records per wait, between the idle (10) and busy (16) thresholds.
    assert not fetch_at_rate(pace, clock, 2_400, 1.0)
    assert fetch_at_rate(pace, clock, 6_000, 0.5)
    assert fetch_at_rate(pace, clock, 2_400, 1.0)
    # Idle again once the input stops.
    assert not fetch_at_rate(pace, clock, 0, 1.0)


def test_a_backlog_turns_busy_within_one_window():
    clock = Clock()
    pace = FetchPace(busy_wait_s=0.005, clock=clock)
    assert not pace.busy(0)
    for _ in range(12):  # full fetches of a backlog, back to back
        clock.now += PACE_WINDOW_S / 10
        busy = pace.busy(64)
    assert busy


def test_no_busy_wait_configured_never_waits():
    clock = Clock()
    pace = FetchPace(busy_wait_s=0.0, clock=clock)
    assert not fetch_at_rate(pace, clock, 10_000, 0.5)
