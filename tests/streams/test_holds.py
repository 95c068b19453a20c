"""Records waiting for their schema ids, held per partition, with a fake clock: only
the partition that needs an unresolved id waits, in order; lookups back off, capped,
for as long as they fail; a stalled partition is paused and resumed once."""

from __future__ import annotations

from streams.holds import PartitionHolds
from streams.records import InputRecord


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def records(partition: int, first: int, count: int) -> list[InputRecord]:
    return [InputRecord("in", partition, o, 0, b"k", b"v") for o in range(first, first + count)]


def offsets(changes) -> list[tuple[int, int]]:
    return [(record.partition, record.offset) for record, _ in changes.ready]


def add(holds: PartitionHolds, chunk: list[InputRecord], ids: list[int | None]):
    return holds.add(chunk, [(r.partition, r.offset) for r in chunk], ids)


def test_only_the_partition_of_an_unresolved_id_waits_and_keeps_its_order():
    holds = PartitionHolds(pause_at=100, clock=Clock())
    # p0: all resolved; p1: offset 1 waits for id 7, and so does everything after it.
    chunk = records(0, 0, 2) + records(1, 0, 3) + records(0, 2, 1)
    changes = add(holds, chunk, [None, None, None, 7, None, None])
    assert offsets(changes) == [(0, 0), (0, 1), (1, 0), (0, 2)]
    assert holds and holds.due() == {7}
    # Later records of p1 wait behind the held ones, even resolved ones; p0 goes on.
    changes = add(holds, records(1, 3, 1) + records(0, 3, 1), [None, None])
    assert offsets(changes) == [(0, 3)]
    holds.looked_up({7}, {})
    changes = holds.release()
    assert offsets(changes) == [(1, 1), (1, 2), (1, 3)]
    assert not holds and not changes.pause and not changes.resume and not changes.stalled


def test_a_failing_lookup_stalls_and_pauses_its_partition_backs_off_capped_and_resumes():
    clock = Clock()
    holds = PartitionHolds(pause_at=100, backoff_s=(0.2, 1.0), clock=clock)
    add(holds, records(2, 10, 2), [9, 9])
    assert holds.due() == {9}
    error = ConnectionError("registry down")
    holds.looked_up({9}, {9: error})
    changes = holds.release()
    assert changes.ready == [] and changes.pause == [("in", 2)]
    assert [(s.partition, s.schema_id, s.error) for s in changes.stalled] == [(("in", 2), 9, error)]
    assert holds.stalled == 1
    # Retried after 0.2 s, then 0.4, 0.8, then every 1.0 s (the cap), for as long as it takes.
    for expected_s in (0.2, 0.4, 0.8, 1.0, 1.0):
        assert holds.due() == set() and abs(holds.next_due_s() - expected_s) < 1e-9
        clock.now_s += expected_s
        assert holds.due() == {9}
        holds.looked_up({9}, {9: error})
        changes = holds.release()
        assert not changes.stalled and not changes.pause  # reported once
    clock.now_s += 1.0
    holds.looked_up(holds.due(), {})
    clock.now_s += 0.5
    changes = holds.release()
    assert offsets(changes) == [(2, 10), (2, 11)]
    assert changes.resume == [("in", 2)]
    (flowing,) = changes.flowing
    assert flowing.partition == ("in", 2) and flowing.held == 2
    assert abs(flowing.stalled_s - 4.9) < 1e-9
    assert not holds and holds.stalled == 0 and holds.next_due_s() is None


def test_a_partition_holding_many_records_is_paused_before_any_lookup_fails():
    holds = PartitionHolds(pause_at=4, clock=Clock())
    assert add(holds, records(0, 0, 3), [5, 5, 5]).pause == []
    assert add(holds, records(0, 3, 1), [None]).pause == [("in", 0)]
    assert add(holds, records(0, 4, 1), [None]).pause == []  # once
    holds.looked_up({5}, {})
    changes = holds.release()
    assert changes.resume == [("in", 0)] and changes.flowing == []  # never stalled
    assert len(changes.ready) == 5


def test_given_up_records_are_returned_and_their_lookups_forgotten():
    holds = PartitionHolds(pause_at=100, clock=Clock())
    add(holds, records(0, 0, 2) + records(1, 0, 1), [3, None, 4])
    holds.looked_up({3, 4}, {3: OSError("down"), 4: OSError("down")})
    holds.release()
    changes = holds.give_up([("in", 0)])
    assert offsets(changes) == [(0, 0), (0, 1)] and len(changes.flowing) == 1
    assert holds.stalled == 1
    changes = holds.give_up()
    assert offsets(changes) == [(1, 0)]
    assert not holds and holds.next_due_s() is None
