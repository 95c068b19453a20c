"""A bare worker that stops itself (SIGSTOP) at the end of its first revoke callback,
still inside the rebalance, as a worker frozen in the middle of one would be:
`python -m tests.chaos.frozen_in_revoke worker -c FILE`. Whoever started it sends
SIGCONT. Used by `tests/chaos/test_exactly_once.py`."""

from __future__ import annotations

import os
import signal

from streams.consumers.confluent import BareConsumer
from tools.cli import main

_finish_revoked = BareConsumer._finish_revoked
_frozen: list[bool] = []


def _finish_revoked_then_freeze(self, consumer, partitions) -> None:
    _finish_revoked(self, consumer, partitions)
    if not _frozen:
        _frozen.append(True)
        os.kill(os.getpid(), signal.SIGSTOP)


BareConsumer._finish_revoked = _finish_revoked_then_freeze

if __name__ == "__main__":
    main()
