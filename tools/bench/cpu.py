"""CPU time of the processes in a benchmark, per step: worker, broker, load generator.

Read from `/proc/<pid>/stat` (user plus system time, every thread), so a figure is
what the process cost the machine, whatever it spent it on. Where `/proc` is missing
(not Linux) the figures are absent, not zero.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of process `pid` so far; None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: split after its closing parenthesis.
    fields = text[text.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


@dataclass(frozen=True)
class CpuSnapshot:
    wall_s: float
    seconds: dict[str, float]


class CpuMeter:
    """CPU seconds of named processes between two snapshots."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self._pids = {name: pid for name, pid in pids.items() if pid is not None}

    def snapshot(self) -> CpuSnapshot:
        seconds = {}
        for name, pid in self._pids.items():
            value = cpu_seconds(pid)
            if value is not None:
                seconds[name] = value
        return CpuSnapshot(time.monotonic(), seconds)

    @staticmethod
    def cores(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
        """Mean cores each process used between the snapshots."""
        wall_s = max(after.wall_s - before.wall_s, 1e-9)
        return {
            name: (after.seconds[name] - before.seconds[name]) / wall_s
            for name in before.seconds
            if name in after.seconds
        }

    @staticmethod
    def per_event_us(before: CpuSnapshot, after: CpuSnapshot, events: int) -> dict[str, float]:
        """CPU µs per event each process spent between the snapshots."""
        if events <= 0:
            return {}
        return {
            name: (after.seconds[name] - before.seconds[name]) / events * 1e6
            for name in before.seconds
            if name in after.seconds
        }
