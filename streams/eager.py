"""Start a coroutine at once, as Python 3.12's eager tasks do, on Python 3.11.

The runner overlaps its stages by running each batch's feature read and model run as
tasks. Most of them never wait: a batch the cache answers reads no store, and a short
model run happens on the event loop (`models/pool.py`). As tasks they would still cost
a task object and a loop iteration each, per batch (together about 3% of a batch of
one, back to back: `python -m tools.bench.stages`). `start` runs the coroutine up to
its first wait right away; one that finishes without waiting returns a future that is
already done, and only one that waits becomes a task, which resumes it where it stopped.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def start(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """`coro`'s outcome, as a future; call on the event loop. Exceptions the coroutine
    raises before its first wait are set on the future, as a task would; BaseExceptions
    that are not Exceptions (a process exit) propagate at once."""
    try:
        awaiting = coro.send(None)
    except StopIteration as finished:
        return _done(finished.value)
    except Exception as exc:
        future = asyncio.get_running_loop().create_future()
        future.set_exception(exc)
        return future
    task = asyncio.ensure_future(_finish(coro, awaiting))
    # A task cancelled before its first step never resumes the coroutine: closed then,
    # its cleanup (`finally`) still runs. Closing a finished coroutine does nothing.
    task.add_done_callback(lambda _: coro.close())
    return task


def _done(value: T) -> asyncio.Future[T]:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


async def _finish(coro: Coroutine[Any, Any, T], awaiting: Any) -> T:
    return await _resume(coro, awaiting)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, T], awaiting: Any) -> Generator[Any, None, T]:
    # The task waits on what the coroutine yielded (a future, or None for a bare yield)
    # as if the coroutine had yielded it to the task itself, then runs the rest of it.
    try:
        yield awaiting
    except BaseException as exc:  # the task's cancellation: the coroutine gets it where it waits
        try:
            awaiting = coro.throw(exc)
        except StopIteration as finished:
            return finished.value
        return (yield from _resume(coro, awaiting))
    return (yield from coro)
