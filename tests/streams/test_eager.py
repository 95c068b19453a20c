"""`eager.start`: a coroutine that never waits is done at once, without a task; one that
waits goes on as a task, and a cancellation reaches it where it waits."""

import asyncio

import pytest

from streams import eager


async def _answer(value):
    return value


async def _fails():
    raise ValueError("bad batch")


async def test_a_coroutine_that_never_waits_is_done_without_a_task():
    tasks_before = len(asyncio.all_tasks())
    future = eager.start(_answer(42))
    assert future.done() and future.result() == 42
    assert len(asyncio.all_tasks()) == tasks_before


async def test_an_error_before_any_wait_is_set_on_the_future():
    future = eager.start(_fails())
    assert future.done()
    with pytest.raises(ValueError, match="bad batch"):
        await future


async def test_a_coroutine_that_waits_runs_up_to_its_wait_at_once_then_as_a_task():
    steps = []
    gate = asyncio.get_running_loop().create_future()

    async def waits():
        steps.append("before")
        value = await gate
        steps.append("after")
        return value + 1

    future = eager.start(waits())
    assert steps == ["before"] and not future.done()
    gate.set_result(1)
    assert await asyncio.wait_for(future, 5) == 2
    assert steps == ["before", "after"]


async def test_waits_after_the_first_are_awaited_too():
    async def waits_twice():
        await asyncio.sleep(0)
        await asyncio.sleep(0.001)
        return "done"

    assert await asyncio.wait_for(eager.start(waits_twice()), 5) == "done"


@pytest.mark.parametrize("wait_ended", [False, True], ids=["waiting", "wait-ended"])
async def test_a_cancellation_reaches_the_coroutine_where_it_waits(wait_ended):
    seen = []
    gate = asyncio.get_running_loop().create_future()

    async def waits():
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = eager.start(waits())
    await asyncio.sleep(0)  # the task's first step: it waits on `gate` now
    if wait_ended:  # the task is due to run, not waiting: the cancel is thrown in
        gate.set_result(None)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled"]


async def test_a_task_cancelled_before_its_first_step_still_cleans_up():
    cleaned = []
    never = asyncio.get_running_loop().create_future()

    async def waits_forever():
        try:
            await never
        finally:
            cleaned.append(True)

    task = eager.start(waits_forever())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]


async def test_an_error_of_what_it_waits_on_reaches_the_coroutine():
    gate = asyncio.get_running_loop().create_future()

    async def waits():
        try:
            await gate
        except KeyError:
            return "handled"

    future = eager.start(waits())
    gate.set_exception(KeyError("store"))
    assert await asyncio.wait_for(future, 5) == "handled"
