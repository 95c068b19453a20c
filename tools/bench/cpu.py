"""CPU time of the processes in a benchmark, per step: worker, broker, load generator.

Read from `/proc/<pid>/stat` (user plus system time, every thread), so a figure is
what the process cost the machine, whatever it spent it on. Where `/proc` is missing
(not Linux) the figures are absent, not zero.

A worker's figure is also split by thread (`/proc/<pid>/task/*/stat`): its main
thread, which runs the event loop (aiokafka's fetching too, on the Faust runtime);
librdkafka's threads (named `rdk:...`: producing, and the bare runtime's fetching);
and the rest, Python's own threads (the bare runtime's poll thread, store reads, ONNX
runs, delivery reports) plus threads that ended in the window. A sampling profile sees
only Python frames; this shows where the process's CPU time went, C included.

The machine as a whole is read too (`/proc/stat`): the cores it kept busy, whatever ran,
and the cores its host took (steal: a virtual machine's CPU ready to run while the host
ran something else). On a shared machine a step that misses its budget while the host
took a share of a core may be the machine's noise rather than the system's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of process `pid` so far; None if it cannot be read."""
    read = _stat(f"/proc/{pid}/stat")
    return None if read is None else read[1]


def thread_cpu_seconds(pid: int) -> dict[str, float] | None:
    """CPU seconds of process `pid` so far: in all (`""`), its main thread (`"loop"`),
    librdkafka's threads (`"librdkafka"`) and the rest (`"threads"`)."""
    total = cpu_seconds(pid)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    if total is None:
        return None
    loop = librdkafka = 0.0
    for tid in tids:
        read = _stat(f"/proc/{pid}/task/{tid}/stat")
        if read is None:
            continue  # ended meanwhile: counted in "threads", from the total
        name, seconds = read
        if tid == str(pid):
            loop = seconds
        elif name.startswith(b"rdk:"):
            librdkafka += seconds
    return {"": total, "loop": loop, "librdkafka": librdkafka,
            "threads": max(0.0, total - loop - librdkafka)}  # fmt: skip


def machine_seconds() -> dict[str, float] | None:
    """CPU seconds of the whole machine so far, summed over its CPUs: `busy` (user, nice,
    system, interrupts) and `stolen` (steal); None without `/proc/stat`."""
    try:
        with open("/proc/stat", "rb") as stat:
            first = stat.readline().split()  # "cpu user nice system idle iowait irq softirq steal"
    except OSError:
        return None
    if first[:1] != [b"cpu"] or len(first) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, first[1:9])
    return {"busy": (user + nice + system + irq + softirq) / _TICKS_PER_S,
            "stolen": steal / _TICKS_PER_S}  # fmt: skip


def _stat(path: str) -> tuple[bytes, float] | None:
    """The command name and user plus system CPU seconds in a `stat` file."""
    try:
        with open(path, "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: split after its closing parenthesis.
    close = text.rindex(b")")
    fields = text[close + 2 :].split()
    return text[text.index(b"(") + 1 : close], (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


@dataclass(frozen=True)
class CpuSnapshot:
    wall_s: float
    seconds: dict[str, float]
    machine: dict[str, float] | None = None
    """`machine_seconds()` at the same moment."""


class CpuMeter:
    """CPU seconds of named processes between two snapshots; those named in `by_thread`
    also as `name/loop`, `name/librdkafka` and `name/threads` (see `thread_cpu_seconds`)."""

    def __init__(self, pids: dict[str, int | None], by_thread: frozenset[str] = frozenset()):
        self._pids = {name: pid for name, pid in pids.items() if pid is not None}
        self._by_thread = by_thread

    def snapshot(self) -> CpuSnapshot:
        seconds = {}
        for name, pid in self._pids.items():
            if name in self._by_thread:
                parts = thread_cpu_seconds(pid) or {}
                seconds.update({f"{name}/{part}" if part else name: value
                                for part, value in parts.items()})  # fmt: skip
                continue
            value = cpu_seconds(pid)
            if value is not None:
                seconds[name] = value
        return CpuSnapshot(time.monotonic(), seconds, machine_seconds())

    @staticmethod
    def machine_cores(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
        """Mean cores the machine kept busy (`busy`) and its host took (`stolen`) between
        the snapshots; empty where they could not be read."""
        if before.machine is None or after.machine is None:
            return {}
        return _spent(before.machine, after.machine, after.wall_s - before.wall_s)

    @staticmethod
    def cores(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
        """Mean cores each process used between the snapshots."""
        return _spent(before.seconds, after.seconds, after.wall_s - before.wall_s)

    @staticmethod
    def per_event_us(before: CpuSnapshot, after: CpuSnapshot, events: int) -> dict[str, float]:
        """CPU µs per event each process spent between the snapshots."""
        if events <= 0:
            return {}
        return _spent(before.seconds, after.seconds, events / 1e6)


def _spent(before: dict[str, float], after: dict[str, float], per: float) -> dict[str, float]:
    """CPU seconds spent by each name read both times, divided by `per` (wall seconds:
    cores; events in millions: µs per event)."""
    per = max(per, 1e-9)
    return {name: (after[name] - before[name]) / per for name in before if name in after}
