"""What the worker's `/healthz/live` and `/healthz/ready` answer, from its own state.

    live   the event loop runs a callback within `health.loop_timeout_ms`, and every
           pipeline with records waiting for an answer (not those held for the schema
           registry) acknowledged a batch within `health.stall_after_s`; the bare
           runtime's poll thread also turned within it. A worker still starting is live.
           Progress is kept per pipeline: one that answers does not hide another that
           is stuck (a hung model run), and the problem names the stuck one.
    ready  models warmed, the group joined (partitions assigned, possibly none; not
           while the group has dropped the worker and it rejoins), a
           bootstrap broker accepts a connection, every feature store's breaker is
           closed, and the worker is not draining.

A failed check answers 503 with one line per problem; Kubernetes restarts a worker
that is not live and keeps one that is not ready out of rollouts and disruption
budgets (consumers take no traffic through a Service).

The checks run on the metrics server's threads; the worker reports to it from the
event loop and the poll thread: plain attribute writes, no lock needed for what is
read as a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from features.breaker import BreakerState
from streams.config import HeadraceConfig

if TYPE_CHECKING:
    from features.lookup import FeatureLookup

LIVE_PATH = "/healthz/live"
READY_PATH = "/healthz/ready"
BROKER_CONNECT_TIMEOUT_S = 1.0

log = logging.getLogger(__name__)


class Health:
    def __init__(self, config: HeadraceConfig, clock: Callable[[], float] = time.monotonic):
        self._stall_after_s = config.health.stall_after_s
        self._loop_timeout_s = config.health.loop_timeout_ms / 1000
        self._brokers = [_host_port(s) for s in config.broker.bootstrap_servers.split(",")]
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lookups: list[FeatureLookup] = []
        self._waiting: dict[str, Callable[[], int]] = {}
        """Per pipeline, its count of records handed to its runner and not answered."""
        self._warmed = False
        self._joined = False
        self._lost_group = False
        self._on_join: list[Callable[[], None]] = []
        self._on_revoke: list[Callable[[], None]] = []
        self._draining = False
        self._progress_at: dict[str, float] = {}
        """Per pipeline, when it last acknowledged a batch (or had nothing waiting)."""
        self._stalled: set[str] = set()
        """The pipelines found stalled, logged once per stall."""
        self._turned_at: float | None = None

    # Reports from the worker -------------------------------------------------------

    def warmed(self, lookups: Sequence[FeatureLookup]) -> None:
        """The models are warm; `lookups` are the pipelines' feature reads."""
        self._lookups = list(lookups)
        self._warmed = True

    def serving(
        self, loop: asyncio.AbstractEventLoop, pipeline: str, waiting: Callable[[], int]
    ) -> None:
        """The runtime's loop runs `pipeline`'s runner; `waiting()` counts records handed
        to it and not answered, except those held for the registry (called from other
        threads). Registering a pipeline again (an agent restarted) replaces its count."""
        self._progress_at.setdefault(pipeline, self._clock())
        self._waiting[pipeline] = waiting
        self._loop = loop

    def answered(self, pipeline: str) -> None:
        """A batch of `pipeline` was acknowledged."""
        self._progress_at[pipeline] = self._clock()

    def turned(self) -> None:
        """The consumer's poll loop went round (bare runtime)."""
        self._turned_at = self._clock()

    def joined(self, yes: bool) -> None:
        """The consumer joined its group (an assignment came), or lost it."""
        self._joined = yes
        self._lost_group = False
        if yes:
            for listener in self._on_join:
                listener()

    def lost_group(self) -> None:
        """The group dropped this worker (its session lapsed: the broker was out of
        reach, or the process frozen); it is not ready until it rejoins."""
        log.warning("the consumer group dropped this worker (its session lapsed): not "
                    "ready until it rejoins")  # fmt: skip
        self._joined = False
        self._lost_group = True

    def on_join(self, listener: Callable[[], None]) -> None:
        """Call `listener` at every assignment (from the consumer's thread)."""
        self._on_join.append(listener)

    def revoked(self) -> None:
        """The consumer's partitions were revoked or lost (a rebalance began)."""
        for listener in self._on_revoke:
            listener()

    def on_revoke(self, listener: Callable[[], None]) -> None:
        """Call `listener` at every revocation (from the consumer's thread)."""
        self._on_revoke.append(listener)

    def draining(self) -> None:
        self._draining = True

    # Checks, from the metrics server's threads ----------------------------------------

    def live(self) -> list[str]:
        """Problems that make the worker not live (none: live)."""
        if self._loop is None:
            return []  # starting: loading and warming models
        problems = []
        if not self._loop_answers():
            problems.append(f"event loop did not answer within {self._loop_timeout_s:g} s")
        now = self._clock()
        for pipeline, waiting in list(self._waiting.items()):
            if waiting() == 0:
                self._progress_at[pipeline] = now  # nothing to do is no stall
                self._stalled.discard(pipeline)
                continue
            stalled_s = now - self._progress_at.get(pipeline, now)
            if stalled_s <= self._stall_after_s:
                self._stalled.discard(pipeline)
                continue
            problem = (
                f"pipeline {pipeline}: records wait and nothing was answered for {stalled_s:.0f} s"
            )
            problems.append(problem)
            if pipeline not in self._stalled:  # probes repeat: once per stall
                self._stalled.add(pipeline)
                log.error("not live: %s", problem)
        if self._turned_at is not None and now - self._turned_at > self._stall_after_s:
            problems.append(f"consumer poll loop stuck for {now - self._turned_at:.0f} s")
        return problems

    def ready(self) -> list[str]:
        """Problems that make the worker not ready (none: ready)."""
        problems = []
        if self._draining:
            problems.append("draining: stopping")
        if not self._warmed:
            problems.append("starting: models warming up")
        elif self._loop is None:
            problems.append("starting: consumer not running yet")
        elif self._lost_group:
            problems.append("consumer group lost this worker (session lapsed); rejoining")
        elif not self._joined:
            problems.append("consumer group not joined yet")
        for lookup in self._lookups:
            if lookup.breaker.state is not BreakerState.CLOSED:
                problems.append(f"feature store of {lookup.service!r} unavailable")
        if not self._broker_reachable():
            brokers = ",".join(f"{host}:{port}" for host, port in self._brokers)
            problems.append(f"no broker of {brokers} accepts a connection")
        return problems

    def answer(self, path: str) -> tuple[int, str] | None:
        """(HTTP status, body) for a health path, None for any other path."""
        check = {LIVE_PATH: self.live, READY_PATH: self.ready}.get(path.rstrip("/"))
        if check is None:
            return None
        problems = check()
        return (503, "\n".join(problems) + "\n") if problems else (200, "ok\n")

    def _loop_answers(self) -> bool:
        answered = threading.Event()
        try:
            self._loop.call_soon_threadsafe(answered.set)
        except RuntimeError:  # closed: the worker is ending
            return False
        return answered.wait(self._loop_timeout_s)

    def _broker_reachable(self) -> bool:
        for host, port in self._brokers:
            try:
                socket.create_connection((host, port), BROKER_CONNECT_TIMEOUT_S).close()
                return True
            except OSError:
                continue
        return False


def _host_port(server: str) -> tuple[str, int]:
    host, _, port = server.strip().rpartition(":")
    return host.strip("[]"), int(port)
