"""aiokafka's send on a connection whose uvloop transport has closed, before aiokafka's
reader task has noticed: the state in which a heartbeat killed the Faust worker's group
coordination as a broker came back."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from aiokafka import errors as aiokafka_errors
from aiokafka.conn import AIOKafkaConnection, AIOKafkaProtocol
from aiokafka.protocol.admin import ApiVersionRequest

from streams.consumers import aiokafka_closed


async def connection_closed_under_aiokafka() -> tuple[AIOKafkaConnection, asyncio.Server]:
    """A connection wired as `AIOKafkaConnection.connect` wires it, whose transport is
    then aborted; no reader task runs, so aiokafka has not seen the close."""
    loop = asyncio.get_running_loop()
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = AIOKafkaConnection("127.0.0.1", port)
    connection._closed_fut = closed = loop.create_future()
    reader = asyncio.StreamReader(loop=loop)
    protocol = AIOKafkaProtocol(closed, reader, loop=loop)
    transport, _ = await loop.create_connection(lambda: protocol, "127.0.0.1", port)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    connection._reader, connection._writer, connection._protocol = reader, writer, protocol
    connection._read_task = loop.create_future()  # what `close` cancels
    transport.abort()
    await asyncio.wait_for(closed, 10)  # connection_lost ran: uvloop closed its handle
    return connection, server


async def send_error() -> BaseException:
    connection, server = await connection_closed_under_aiokafka()
    try:
        connection.send(ApiVersionRequest())
    except Exception as exc:
        return exc
    finally:
        server.close()
    pytest.fail("send on a closed transport did not fail")


def test_uvloop_raises_runtime_error_on_a_closed_transport_without_the_patch(monkeypatch):
    """Guards the premise: should uvloop or aiokafka change, this says so."""
    monkeypatch.setattr(AIOKafkaConnection, "send", aiokafka_closed.aiokafka_send)
    error = uvloop.run(send_error())
    assert isinstance(error, RuntimeError), error


def test_a_send_on_a_closed_transport_fails_as_a_broken_connection(monkeypatch):
    monkeypatch.setattr(AIOKafkaConnection, "send", aiokafka_closed.aiokafka_send)
    aiokafka_closed.install()
    error = uvloop.run(send_error())
    assert isinstance(error, aiokafka_errors.KafkaConnectionError), error
    assert error.retriable
