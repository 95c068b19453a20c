"""The Faust runtime's read-back at an assignment (`_AssignmentChecks`): only a
partition's latest check counts. Two rebalances in a row start two checks of one
partition; the first, which read less, may end last."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from faust.types import TP

from streams.consumers.faust import _AssignmentChecks
from streams.replay import Replay

PARTITION = ("transactions", 0)


class Scans:
    """The read-back: each scan finds the offsets it is given, once the test lets it end."""

    def __init__(self) -> None:
        self.ends: list[tuple[threading.Event, frozenset[int]]] = []
        self.lock = threading.Lock()

    def prepare(self, *answered: int) -> threading.Event:
        end = threading.Event()
        with self.lock:
            self.ends.append((end, frozenset(answered)))
        return end

    def scan(self, partitions) -> dict:
        with self.lock:
            end, answered = self.ends.pop(0)
        assert end.wait(10)
        return {where: Replay(answered=answered) for where in partitions}


class Runner:
    def __init__(self) -> None:
        self.replays: dict = {}

    def answered_before(self, found: dict) -> None:  # replaces, as the runner's does
        self.replays.update(found)


async def test_a_check_of_an_earlier_assignment_that_ends_last_is_ignored():
    scans, runner = Scans(), Runner()
    checks = _AssignmentChecks(scans)
    checks.runners[PARTITION[0]] = runner
    first_end = scans.prepare(5)  # the first assignment's: the answer to offset 5 only
    checks.start({TP(*PARTITION)})
    first = checks.pending[PARTITION]
    second_end = scans.prepare(5, 6, 7)  # since then, another owner answered 6 and 7
    checks.start({TP(*PARTITION)})

    second_end.set()
    await asyncio.wait_for(checks.wait([SimpleNamespace(topic=PARTITION[0], partition=0)]), 10)
    assert runner.replays[PARTITION].answered == {5, 6, 7}
    first_end.set()
    await asyncio.wait_for(first, 10)
    assert runner.replays[PARTITION].answered == {5, 6, 7}  # not replaced by the older check
