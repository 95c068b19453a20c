"""The completion model: measured service times, counted work ahead, a clock passed in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.admit import CompletionModel, RecentTimes, SizedTimes


def test_sized_times_scale_from_the_nearest_measured_size():
    times = SizedTimes(window_s=2.0)
    assert times.bounds(0.0)(8) == 0.0
    times.observe(8, 0.040, now_s=0.0)
    bound = times.bounds(0.1)
    assert bound(8) == bound(5) == pytest.approx(0.040)
    assert bound(16) == pytest.approx(0.080)
    assert times.bounds(3.0)(8) == 0.0  # forgotten


def test_a_time_mostly_per_batch_scales_only_in_its_per_event_share():
    times = SizedTimes(window_s=2.0, per_event_share=0.1)
    times.observe(1, 0.020, now_s=0.0)
    bound = times.bounds(0.1)
    assert bound(1) == pytest.approx(0.020)
    assert bound(4) == pytest.approx(0.026)  # 20 ms per batch, a tenth of it per event
    times.observe(8, 0.030, now_s=0.2)
    assert times.bounds(0.3)(6) == pytest.approx(0.030)  # its own bucket once measured
    later = SizedTimes(window_s=2.0, per_event_share=0.1)
    later.observe(64, 0.080, now_s=0.0)  # an overload's batches, their queueing included
    assert later.bounds(0.1)(2) == pytest.approx(0.0025)  # down: linear, soon measured


def test_a_start_measured_on_single_events_does_not_shed_the_first_larger_batch():
    # The worker's first batches held one event each: 24 ms outside the model (the store
    # read and the publish round trip), 0.5 ms of model. Then a batch of 4 with 60 ms
    # left: its estimate must stay near the measured per-batch time, not 4 x 24 ms.
    model = CompletionModel(sessions=1)
    model.full_runs.observe(1, 0.0005, now_s=0.0)
    model.rest.observe(1, 0.024, now_s=0.0)
    assert model.estimates(now_s=0.1, batch_size=4).full_s(4) < 0.040


def test_sized_times_bounds_follow_each_observation_and_each_expiry():
    times = SizedTimes(window_s=2.0, quantile=0.99)
    times.observe(8, 0.080, now_s=0.0)
    assert times.bounds(0.5)(8) == pytest.approx(0.080)
    times.observe(8, 0.010, now_s=1.0)
    assert times.bounds(1.5)(8) == pytest.approx(0.080)  # the slow one is still in
    assert times.bounds(2.5)(8) == pytest.approx(0.010)  # ... and out at 2.0
    assert times.bounds(2.6)(8) == pytest.approx(0.010)
    assert times.bounds(3.5)(8) == 0.0


# (a batch size, or 0 to ask for bounds; its seconds; how far the clock moves first)
_STEPS = st.lists(
    st.tuples(st.integers(0, 40), st.floats(0.0001, 0.1), st.floats(0.0, 0.8)), max_size=60
)


@given(_STEPS)
def test_bounds_kept_between_observations_are_those_computed_afresh(steps):
    # The bounds are updated per observation, not computed again: they must not differ
    # from those of a twin that computes them afresh every time.
    kept = SizedTimes(window_s=2.0, quantile=0.9, per_event_share=0.3, outliers=1)
    now_s = 0.0
    observed: list[tuple[int, float, float]] = []
    for size, seconds, step_s in steps:
        now_s += step_s
        if size:
            kept.observe(size, seconds, now_s)
            observed.append((size, seconds, now_s))
            continue
        fresh = SizedTimes(window_s=2.0, quantile=0.9, per_event_share=0.3, outliers=1)
        for observed_size, observed_s, at_s in observed:
            fresh.observe(observed_size, observed_s, at_s)
        for asked in (1, 2, 3, 8, 33, 64):
            assert kept.bounds(now_s)(asked) == fresh.bounds(now_s)(asked)


def test_recent_times_bound_is_a_high_quantile_of_the_window():
    times = RecentTimes(window_s=2.0, quantile=0.9)
    assert times.bound(now_s=0.0) == 0.0  # nothing measured: optimistic, so it measures
    for i in range(10):
        times.observe(0.010 + i * 0.001, now_s=i * 0.1)
    assert times.bound(now_s=1.0) == pytest.approx(0.018)
    times.observe(0.500, now_s=1.0)  # a stall
    assert times.bound(now_s=1.0) == pytest.approx(0.019)
    times.observe(0.500, now_s=1.0)
    assert times.bound(now_s=1.0) == pytest.approx(0.5)
    # The stall is forgotten once it leaves the window.
    times.observe(0.012, now_s=3.5)
    assert times.bound(now_s=3.5) == pytest.approx(0.012)


def test_one_stall_in_a_workers_first_seconds_is_not_its_estimate():
    # Ten batches of 15 answered in 8 ms, then one whose publish was acknowledged 90 ms
    # late (the broker stalled). With 90 ms left to use, the next batch is admitted; a
    # second stall is a slowdown, and counts.
    model = CompletionModel(sessions=1)
    for i in range(10):
        model.full_runs.observe(15, 0.0005, now_s=i * 0.1)
        model.rest.observe(15, 0.008, now_s=i * 0.1)
    model.rest.observe(15, 0.090, now_s=1.0)
    assert model.estimates(now_s=1.1, batch_size=15).full_s(15) < 0.010
    model.rest.observe(15, 0.090, now_s=1.1)
    assert model.estimates(now_s=1.2, batch_size=15).full_s(15) >= 0.090


def test_a_bound_rests_on_its_only_duration():
    times = RecentTimes(window_s=2.0, quantile=0.95, outliers=1)
    times.observe(0.050, now_s=0.0)
    assert times.bound(now_s=0.1) == pytest.approx(0.050)
    times.observe(0.010, now_s=0.1)
    assert times.bound(now_s=0.2) == pytest.approx(0.010)


def test_work_admitted_ahead_delays_a_batch_until_its_run_ends():
    model = CompletionModel(sessions=1)
    model.full_runs.observe(4, 0.020, now_s=0.0)  # a run of 4 events takes 20 ms
    model.rest.observe(4, 0.005, now_s=0.0)  # decode, features and publish: 5 ms
    alone = model.estimates(now_s=0.1, batch_size=4).full_s(4)
    assert alone == pytest.approx(0.025)
    first = model.reserve(4, 4, now_s=0.1)
    behind = model.estimates(now_s=0.1, batch_size=4)
    assert behind.full_s(4) == pytest.approx(0.045)
    assert behind.fallback_s == pytest.approx(0.025)  # ordered behind it too
    # The reserved batch itself does not wait for its own run.
    assert model.estimates(0.1, 4, own=first).full_s(4) == pytest.approx(0.025)
    model.release_model(first)
    assert model.estimates(now_s=0.1, batch_size=4).full_s(4) == pytest.approx(0.025)


def test_work_ahead_is_shared_by_the_sessions():
    model = CompletionModel(sessions=2)
    model.full_runs.observe(4, 0.020, now_s=0.0)
    model.reserve(4, 4, now_s=0.0)
    model.reserve(4, 4, now_s=0.0)
    assert model.estimates(now_s=0.0, batch_size=4).full_s(4) == pytest.approx(0.040)


def test_warm_up_runs_stand_in_until_something_is_measured():
    model = CompletionModel(sessions=1)
    model.seed({4: 0.010}, fallback_run_s=0.001)
    first = model.estimates(now_s=0.0, batch_size=4)
    assert (first.full_s(4), first.fallback_s) == (pytest.approx(0.010), pytest.approx(0.001))
    model.full_runs.observe(4, 0.030, now_s=1.0)
    assert model.estimates(now_s=1.0, batch_size=4).full_s(4) == pytest.approx(0.030)


def test_a_reservation_counts_the_warm_up_run_time_until_something_is_measured():
    model = CompletionModel(sessions=1)
    model.seed({4: 0.010})
    assert model.reserve(4, 4, now_s=0.0).model_s == pytest.approx(0.010)
    assert model.estimates(now_s=0.0, batch_size=4).full_s(4) == pytest.approx(0.020)


def test_publishes_admitted_ahead_delay_a_batch_when_they_are_the_longer_line():
    # Under overload most batches carry cheap answers: no model work, but each is a
    # publish, one after another. Measured on the bare runtime at three times capacity
    # (batches of 16): OK answers waited up to 85 ms for earlier batches' publishes.
    model = CompletionModel(sessions=1)
    model.full_runs.observe(4, 0.010, now_s=0.0)
    model.rest.observe(4, 0.015, now_s=0.0)  # decode, features and its own publish
    model.publishes.observe(4, 0.012, now_s=0.0)
    ahead = [model.reserve(0, 4, now_s=0.1) for _ in range(5)]  # five batches, no model work
    behind = model.estimates(now_s=0.1, batch_size=4)
    assert behind.full_s(4) == pytest.approx(5 * 0.012 + 0.015)  # 60 ms of publishes ahead
    assert behind.fallback_s == pytest.approx(5 * 0.012 + 0.015)
    # Model work ahead and publishes ahead overlap: the longer line counts, not both.
    model.reserve(4, 4, now_s=0.1)
    own = model.reserve(4, 4, now_s=0.1)
    assert model.estimates(0.1, 4, own=own).full_s(4) == pytest.approx(6 * 0.012 + 0.015)
    for reservation in ahead:
        model.published(reservation, 4, 0.012, now_s=0.1)
    assert model.estimates(0.1, 4, own=own).full_s(4) == pytest.approx(0.010 + 0.010 + 0.015)


def test_publishes_that_overlap_are_not_counted_as_a_line():
    model = CompletionModel(sessions=1, publishes_overlap=True)  # transactions: handed over
    model.publishes.observe(4, 0.050, now_s=0.0)  # while one commits
    model.reserve(0, 4, now_s=0.1)
    assert model.estimates(now_s=0.1, batch_size=4).full_s(4) == 0.0


def test_publishes_ahead_count_at_their_mean_and_a_batchs_own_at_its_high_quantile():
    # Publishes of 10 ms with two stalls of 100 ms among them: five batches ahead wait
    # about five means, not five stalls; the batch's own publish, inside `rest`, still
    # counts at its high quantile (the stalls, two in ten).
    model = CompletionModel(sessions=1)
    for seconds in [0.010] * 8 + [0.100] * 2:
        model.publishes.observe(4, seconds, now_s=0.0)
        model.rest.observe(4, seconds, now_s=0.0)
    for _ in range(5):
        model.reserve(0, 4, now_s=0.1)
    mean_s = (8 * 0.010 + 2 * 0.100) / 10
    estimate_s = model.estimates(now_s=0.1, batch_size=4).full_s(4)
    assert estimate_s == pytest.approx(5 * mean_s + 0.100)  # 240 ms, not 600 ms
