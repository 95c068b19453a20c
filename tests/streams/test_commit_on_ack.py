"""`broker.commit_interval_ms: 0` on the bare runtime: each acknowledgement commits the
stored offsets at once, one commit at a time; what is acknowledged while one is in
flight goes in the next, so commits follow the batches without piling up."""

from __future__ import annotations

from types import SimpleNamespace

from confluent_kafka import KafkaError

from streams.consumers import confluent
from streams.consumers.confluent import BareConsumer


def committing_consumer(commits: list[bool]) -> BareConsumer:
    """What `_commit_stored` and the commit callback use of the consumer."""
    bare = object.__new__(BareConsumer)
    bare._consumer = SimpleNamespace(commit=lambda asynchronous: commits.append(asynchronous))
    bare._committing_since, bare._commit_again = None, False
    return bare


def test_an_acknowledgement_commits_at_once_and_those_during_a_commit_go_in_the_next():
    commits: list[bool] = []
    bare = committing_consumer(commits)
    bare._commit_stored()
    assert commits == [True]  # asynchronous: the poll thread goes on
    bare._commit_stored()
    bare._commit_stored()  # two more batches acknowledged while it is in flight
    assert commits == [True]
    bare._committed(None, [])
    assert commits == [True, True]  # one commit carries both
    bare._committed(None, [])
    assert commits == [True, True]  # nothing acknowledged meanwhile: nothing to commit
    bare._commit_stored()
    assert commits == [True, True, True]


def test_a_failed_commit_does_not_stop_the_next_one():
    commits: list[bool] = []
    bare = committing_consumer(commits)
    bare._commit_stored()
    bare._commit_stored()
    bare._committed(KafkaError(KafkaError.REQUEST_TIMED_OUT), [])
    assert commits == [True, True]  # what it carried is stored: the next commit takes it
    bare._committed(KafkaError(KafkaError._NO_OFFSET), [])
    bare._commit_stored()
    assert commits == [True, True, True]


def test_a_commit_never_reported_holds_the_next_back_only_for_a_while(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(confluent.time, "monotonic", lambda: now[0])
    commits: list[bool] = []
    bare = committing_consumer(commits)
    bare._commit_stored()
    now[0] += confluent.COMMIT_HOLD_S / 2
    bare._commit_stored()
    assert commits == [True]  # held back: the first is still in flight
    now[0] += confluent.COMMIT_HOLD_S
    bare._commit_stored()
    assert commits == [True, True]  # its result never came: the next goes anyway
