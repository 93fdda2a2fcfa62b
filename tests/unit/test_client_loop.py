"""The synchronous Client's loop thread (expstore_client._loop)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc

from expstore_client._loop import LoopThread


def test_an_iterator_collected_on_the_loop_thread_is_closed_there():
    """A Client's stream or sampler dropped without being closed may be collected by a
    garbage collection that runs on the loop thread: closing it there must neither raise
    nor wait for the loop (which is this thread), and still close the async iterator."""
    loop = LoopThread()
    closed = concurrent.futures.Future()

    async def rows():
        try:
            for i in range(10):
                yield i
        finally:
            closed.set_result(True)

    it = loop.iterate(rows())
    assert next(it) == 0
    errors = []

    def drop_on_loop():
        loop.loop.set_exception_handler(lambda _, context: errors.append(context))
        try:
            it.close()  # what the collector does to a suspended generator
        except BaseException as e:  # noqa: BLE001 (the test reports it)
            errors.append(e)

    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop.loop).result(5)
    loop.loop.call_soon_threadsafe(drop_on_loop)
    assert closed.result(5) is True
    gc.collect()
    assert errors == []
