"""The deadline of a graceful stop (`drain_timeout_s`).

On SIGTERM a runtime stops fetching, answers and commits what it holds, and leaves its
group. A `DrainDeadline` started then ends the process once the deadline passes,
whatever the drain still waits for (a store or a broker that does not answer): nothing
unwritten was committed, so the next owner of the partitions answers what was left,
and Kubernetes never has to SIGKILL a worker mid-commit at the end of its grace period.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

# The exit status of a worker that gave up on what it held (as for an unwritable batch).
EXIT_DRAIN_LATE = 70
# Of the deadline, what the final commit and the group leave may take at most.
CLOSE_RESERVE_S = 5.0


class DrainDeadline:
    """Started when a stop begins; `met()` once the worker drained and left its group."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._started = time.monotonic()
        self._timer = threading.Timer(timeout_s, self._expired)
        self._timer.daemon = True
        self._timer.name = "drain-deadline"
        self._timer.start()
        log.info("stopping: draining within %.0f s", timeout_s)

    def drain_left_s(self) -> float:
        """Seconds left to answer what is held, keeping time for the commit and the leave."""
        reserve = min(CLOSE_RESERVE_S, self.timeout_s / 4)
        return max(0.0, self.timeout_s - reserve - self.elapsed_s())

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def met(self) -> None:
        self._timer.cancel()
        log.info("drained and left the group in %.2f s", self.elapsed_s())

    def _expired(self) -> None:
        log.critical(
            "drain_timeout_s (%.0f s) passed before the worker drained: exiting; what it "
            "had not committed is answered by the next owner of its partitions",
            self.timeout_s,
        )
        logging.shutdown()
        os._exit(EXIT_DRAIN_LATE)
