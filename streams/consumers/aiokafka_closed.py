"""aiokafka's send on a connection the broker has closed fails as a broken connection
on uvloop too.

aiokafka turns an `OSError` from its socket write into `KafkaConnectionError`, which
its callers retry (look the coordinator up again, reconnect). The standard event loop's
transport drops a write after the connection is lost; uvloop's raises `RuntimeError`
("the handler is closed") once it has closed its handle. Between the broker closing the
connection and aiokafka's reader task noticing it, a heartbeat or commit sent on that
connection therefore raised `RuntimeError`, which aiokafka's group coordination treats
as fatal: it stopped for good and the Faust worker exited as the broker came back.

`install()` makes the send check its transport first: one that is closing fails the way
a broken socket does.
"""

from __future__ import annotations

from typing import Any

from aiokafka import errors as aiokafka_errors
from aiokafka.conn import AIOKafkaConnection, CloseReason

aiokafka_send = AIOKafkaConnection.send


def _send(self: AIOKafkaConnection, request: Any, expect_response: bool = True) -> Any:
    writer = self._writer
    if writer is not None and writer.transport.is_closing():
        self.close(reason=CloseReason.CONNECTION_BROKEN)
        raise aiokafka_errors.KafkaConnectionError(
            f"Connection at {self.host}:{self.port} broken: its transport is closed"
        )
    return aiokafka_send(self, request, expect_response)


def install() -> None:
    """Patch `AIOKafkaConnection.send` (idempotent)."""
    AIOKafkaConnection.send = _send
