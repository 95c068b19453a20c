"""A pool of ONNX sessions: several CPU sessions (and CUDA ones where usable), each
running on its own thread, with each batch routed to the session expected to finish
it first from its queue and its measured service time.
"""

from __future__ import annotations

from typing import Any

from models.config import ModelConfig
from models.errors import ModelError
from models.session import Feeds, ModelSession
from models.signature import Signature

_EWMA = 0.2
# A run expected to take less than this runs on the caller's thread (the event loop):
# handing it to a session's thread and back costs more CPU than the run itself
# (~100 µs of wake-ups and future hand-offs against ~30 µs for the sample model at one
# row), and a loop blocked this long delays nothing measurably.
INLINE_RUN_S = 0.0003


def warmup_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Every size up to 128 (what a light-load batcher emits), then powers of two and the max."""
    sizes = set(range(1, min(max_batch_size, 128) + 1))
    sizes.update(2**i for i in range(8, 13) if 2**i <= max_batch_size)
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


class _Member:
    def __init__(self, session: ModelSession) -> None:
        self.session = session
        self.outstanding = 0
        self.runs = 0
        self.rows = 0
        self.seconds_per_row: float | None = None
        self.overhead_s: float | None = None

    def expected_finish_s(self, rows: int) -> float:
        if self.seconds_per_row is None or self.overhead_s is None:
            return float(self.outstanding)  # unmeasured: spread by queue length
        return (self.outstanding + 1) * self.expected_run_s(rows)

    def expected_run_s(self, rows: int) -> float:
        """One run's measured cost (the warm-up's until runs are measured)."""
        if self.seconds_per_row is None or self.overhead_s is None:
            return self.session.warmup_seconds.get(rows, float("inf"))
        return self.overhead_s + self.seconds_per_row * rows

    def runs_inline(self, rows: int) -> bool:
        """Whether a run of `rows` is cheaper on the caller's thread: a CPU session with
        nothing queued on its own thread, and a run measured short."""
        return (
            self.session.device == "cpu"
            and self.outstanding == 0
            and self.expected_run_s(rows) < INLINE_RUN_S
        )

    def observe(self, rows: int, seconds: float) -> None:
        self.runs += 1
        self.rows += rows
        # A crude split into fixed and per-row cost, good enough to compare devices.
        per_row = seconds / max(rows, 1)
        if self.seconds_per_row is None:
            self.seconds_per_row, self.overhead_s = per_row, seconds / 2
        else:
            self.seconds_per_row += _EWMA * (per_row - self.seconds_per_row)
            self.overhead_s += _EWMA * (seconds - self.seconds_per_row * rows - self.overhead_s)


class SessionPool:
    """`await run_timed(feeds)` on the session that should finish first. Call `close()`.

    Sessions are created and warmed up (at every size in `batch_sizes`) before the
    constructor returns; it blocks for that long.
    """

    def __init__(self, config: ModelConfig, batch_sizes: tuple[int, ...] = (1,)) -> None:
        if config.cpu_sessions + config.cuda_sessions < 1:
            raise ModelError("a session pool needs at least one session")
        self._members: list[_Member] = []
        try:
            for device, count in (("cuda", config.cuda_sessions), ("cpu", config.cpu_sessions)):
                for _ in range(count):
                    session = ModelSession(config, device, batch_sizes)
                    self._members.append(_Member(session))
        except Exception:
            self.close()
            raise
        self.signature: Signature = self._members[0].session.signature

    @property
    def providers(self) -> list[list[str]]:
        """The providers each session really got (CUDA requests may have fallen back)."""
        return [m.session.providers for m in self._members]

    @property
    def warmup_seconds(self) -> dict[int, float]:
        """Per batch size, the slowest session's warm-up run: a first estimate of run times."""
        sizes = self._members[0].session.warmup_seconds
        return {n: max(m.session.warmup_seconds[n] for m in self._members) for n in sizes}

    @property
    def usage(self) -> list[dict]:
        """Per session: its device, the batches and the rows it ran (where routing sent work)."""
        return [{"device": m.session.device, "runs": m.runs, "rows": m.rows}
                for m in self._members]  # fmt: skip

    @property
    def size(self) -> int:
        """Sessions in the pool: how many batches run at once."""
        return len(self._members)

    async def run_timed(self, feeds: Feeds) -> tuple[list[dict[str, Any]], float]:
        """Answers and the seconds the run itself took (not the wait for a session)."""
        rows = len(next(iter(feeds.values())))
        member = min(self._members, key=lambda m: m.expected_finish_s(rows))
        if member.runs_inline(rows):
            answers, seconds = member.session.run_measured(feeds)
            member.observe(rows, seconds)
            return answers, seconds
        member.outstanding += 1
        try:
            answers, seconds = await member.session.run_timed(feeds)
        finally:
            member.outstanding -= 1
        member.observe(rows, seconds)
        return answers, seconds

    def run_blocking(self, feeds: Feeds) -> list[dict[str, Any]]:
        return self._members[0].session.run(feeds)

    def close(self) -> None:
        for member in self._members:
            member.session.close()
