"""Admission and the degradation ladder, with a controlled clock and service times."""

from __future__ import annotations

from collections import deque

import pytest

from streams.admit import (
    DEADLINE_AT_RISK,
    DEADLINE_PASSED,
    LOW_PRIORITY,
    Admission,
    Candidate,
    Estimates,
    Ladder,
    RecentTimes,
    Route,
    SizedTimes,
)

BUDGET_S = 0.100
FULL_LADDER = Ladder(fallback_model=True, answer_cache=True, default_answer=True)


def admission(ladder: Ladder = FULL_LADDER, shares=(0.5, 1.0), margin_share=0.0) -> Admission:
    return Admission(BUDGET_S, shares, ladder, margin_share)


NOW_S = 1_000.0


def estimates(full_s=0.030, fallback_s=0.005, per_event_s=0.0) -> Estimates:
    """A batch with n events for the full model takes full_s + (n - 1) * per_event_s."""
    return Estimates(lambda n: full_s + (n - 1) * per_event_s, fallback_s)


def decide(admit: Admission, left_s, priority=1, full_s=0.030, fallback_s=0.005, cached=False):
    candidate = Candidate(NOW_S + left_s, priority, cached)
    return admit.decide([candidate], NOW_S, estimates(full_s, fallback_s))[0]


def test_an_event_that_can_finish_in_time_takes_the_full_model():
    decision = decide(admission(), left_s=0.080)
    assert (decision.route, decision.reason) == (Route.FULL, None)


def test_an_event_at_risk_goes_to_the_fallback_model_while_it_can_still_finish():
    decision = decide(admission(), left_s=0.020)
    assert (decision.route, decision.reason) == (Route.FALLBACK, DEADLINE_AT_RISK)


def test_an_event_past_its_deadline_never_costs_inference():
    decision = decide(admission(), left_s=-0.5, cached=True)
    assert (decision.route, decision.reason) == (Route.CACHED, DEADLINE_PASSED)


@pytest.mark.parametrize(
    ("ladder", "cached", "route"),
    [
        (FULL_LADDER, True, Route.CACHED),
        (FULL_LADDER, False, Route.DEFAULT),
        (Ladder(answer_cache=True), True, Route.CACHED),
        (Ladder(answer_cache=True), False, Route.SHED),
        (Ladder(default_answer=True), True, Route.DEFAULT),
        (Ladder(), True, Route.SHED),
    ],
)
def test_the_ladder_is_tried_in_order_and_ends_in_a_shed_record(ladder, cached, route):
    # Too late even for the fallback model (its run would take 5 ms, 2 ms are left).
    assert decide(admission(ladder), left_s=0.002, cached=cached).route is route


def test_a_low_priority_may_use_only_its_share_of_the_budget():
    admit = admission(shares=(0.5, 1.0))
    # 60 ms left, 30 ms needed: priority 1 fits; priority 0 must keep 50 ms in hand.
    assert decide(admit, left_s=0.060, priority=1).route is Route.FULL
    low = decide(admit, left_s=0.060, priority=0)
    assert (low.route, low.reason) == (Route.FALLBACK, LOW_PRIORITY)
    # ... and degrades further down the ladder, sooner than the high priority would.
    assert decide(admit, left_s=0.052, priority=0, fallback_s=0.005).route is Route.DEFAULT
    assert decide(admit, left_s=0.052, priority=1, fallback_s=0.005).route is Route.FULL


def test_a_margin_of_the_budget_is_kept_in_hand():
    # 35 ms left, 30 ms needed: taken without a margin, not with 10 ms of it.
    assert decide(admission(margin_share=0.0), left_s=0.035).route is Route.FULL
    with_margin = decide(admission(margin_share=0.1), left_s=0.035)
    assert (with_margin.route, with_margin.reason) == (Route.FALLBACK, DEADLINE_AT_RISK)


def test_priorities_outside_the_configured_range_are_clamped():
    admit = admission(shares=(0.5, 0.75, 1.0))
    assert (admit.clamp(-3), admit.clamp(1), admit.clamp(99)) == (0, 1, 2)


def test_budget_shares_must_be_fractions():
    with pytest.raises(ValueError, match="shares"):
        Admission(BUDGET_S, (0.0, 1.0), FULL_LADDER)


def test_a_batch_takes_only_as_many_full_events_as_can_all_finish_in_time():
    admit = admission()
    # 10 ms for one event, 5 ms more per event; each event has 31 ms left.
    batch = [Candidate(NOW_S + 0.031, 1, False) for _ in range(6)]
    routes = [d.route for d in admit.decide(batch, NOW_S, estimates(0.010, 0.002, 0.005))]
    # 5 events take 30 ms: the sixth would make all of them late.
    assert routes == [Route.FULL] * 5 + [Route.FALLBACK]


def test_a_batch_whose_events_can_all_wait_for_it_is_taken_with_one_estimate():
    admit = admission()
    asked: list[int] = []

    def full_s(n: int) -> float:
        asked.append(n)
        return 0.010 + (n - 1) * 0.005

    batch = [Candidate(NOW_S + 0.031 + i * 0.001, 1, False) for i in range(5)]
    decisions = admit.decide(batch, NOW_S, Estimates(full_s, 0.002))
    assert [d.route for d in decisions] == [Route.FULL] * 5
    assert asked == [5]  # 30 ms for all five, within the tightest 31 ms
    asked.clear()
    decisions = admit.decide([*batch, Candidate(NOW_S + 0.031, 1, False)], NOW_S,
                             Estimates(full_s, 0.002))  # fmt: skip
    assert [d.route for d in decisions] == [Route.FULL] * 5 + [Route.FALLBACK]
    assert asked == [6, 1, 2, 3, 4, 5, 6]  # not all of them: event by event


def test_an_urgent_event_limits_how_many_join_it():
    admit = admission()
    urgent = Candidate(NOW_S + 0.016, 1, False)
    relaxed = [Candidate(NOW_S + 0.090, 1, False) for _ in range(3)]
    decisions = admit.decide([urgent, *relaxed], NOW_S, estimates(0.010, 0.002, 0.005))
    # Urgent alone: 10 ms; with one more: 15 ms; with two: 20 ms, past its 16 ms.
    assert [d.route for d in decisions] == [Route.FULL, Route.FULL, Route.FALLBACK, Route.FALLBACK]
    assert decisions[2].reason == DEADLINE_AT_RISK


def test_batch_time_bounds_follow_new_measurements_and_forget_old_ones():
    times = SizedTimes(window_s=1.0, quantile=1.0)
    times.observe(size=4, seconds=0.010, now_s=0.0)
    assert times.bounds(0.5)(4) == pytest.approx(0.010)
    times.observe(size=4, seconds=0.030, now_s=0.6)  # a new measurement counts at once
    assert times.bounds(0.7)(4) == pytest.approx(0.030)
    assert times.bounds(1.2)(8) == pytest.approx(0.060)  # scaled from the nearest size
    assert times.bounds(1.7)(4) == 0.0  # both left the window: nothing measured lately


def simulate(offered_per_capacity: float, seconds: float = 20.0) -> dict:
    """One server answering a FIFO queue at 3x its capacity, admission deciding each event.

    The full model takes 10 ms per event; cheap answers take no time. Events arrive on a
    fixed schedule, alternating priorities 0 and 1. Returns per priority the routes and
    the latency of the full answers.
    """
    service_s = 0.010
    gap_s = service_s / offered_per_capacity
    admit = admission(Ladder(), shares=(0.5, 1.0))
    times = RecentTimes(window_s=1.0)
    arrivals = deque((i * gap_s, i % 2) for i in range(int(seconds / gap_s)))
    now = 0.0
    outcomes: dict = {0: [], 1: []}
    while arrivals:
        arrived, priority = arrivals.popleft()
        now = max(now, arrived)
        bound = times.bound(now)
        candidate = Candidate(arrived + BUDGET_S, priority, cached=False)
        decision = admit.decide([candidate], now, Estimates(lambda _n, b=bound: b, 0.0))[0]
        if decision.route is Route.FULL:
            now += service_s
            times.observe(service_s, now)
            outcomes[priority].append(("OK", now - arrived))
        else:
            outcomes[priority].append((decision.route.status, None))
    return outcomes


def _ok_share(answers) -> float:
    return sum(1 for status, _ in answers if status == "OK") / len(answers)


def test_under_three_times_capacity_answers_in_full_stay_within_the_budget():
    outcomes = simulate(offered_per_capacity=3.0)
    latencies = [s for answers in outcomes.values() for status, s in answers if status == "OK"]
    answered = sum(len(answers) for answers in outcomes.values())
    assert max(latencies) <= BUDGET_S + 1e-9
    # Capacity is a third of the offer: about that many are answered in full.
    assert 0.28 <= len(latencies) / answered <= 0.34


def test_under_overload_high_priority_is_served_first():
    outcomes = simulate(offered_per_capacity=3.0)
    assert _ok_share(outcomes[1]) >= 0.6
    assert _ok_share(outcomes[0]) <= 0.1


def test_below_capacity_everything_is_answered_in_full():
    outcomes = simulate(offered_per_capacity=0.5)
    assert _ok_share(outcomes[0]) == _ok_share(outcomes[1]) == 1.0
