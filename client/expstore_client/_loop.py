"""The background event loop that runs the synchronous Client's coroutines.

One loop thread per process, shared by every ``Client`` (as LanceDB does): the clients'
gRPC channels live on it, and a synchronous call is a coroutine handed to it
(``run_coroutine_threadsafe``) whose result the calling thread waits for. Calls made by
one thread start on the loop in the order they were made. A forked child starts a loop
of its own on its first call (a client made before the fork cannot be used after it,
as with any gRPC channel).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, AsyncIterator, Awaitable, Coroutine, Iterator, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="expstore-client-loop", daemon=True)
        self._closing: set[asyncio.Task] = set()  # closes started on the loop (iterate), held until done
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a synchronous expstore Client was called from its own event loop: "
                               "use AsyncClient in asyncio code")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result; an interrupted wait (Ctrl-C)
        cancels it."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def iterate(self, iterator: AsyncIterator[T]) -> Iterator[T]:
        """An async iterator, pulled item by item from this thread; closing the
        returned iterator closes it (cancelling what it has in flight)."""
        try:
            while True:
                try:
                    item = self.run(_anext(iterator))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            close = getattr(iterator, "aclose", None)
            if close is not None:
                if threading.current_thread() is self._thread:
                    # Garbage-collected on the loop's own thread, which cannot wait for itself.
                    task = self.loop.create_task(close())
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)
                else:
                    self.run(close())


async def _anext(iterator: AsyncIterator[T]) -> T:
    return await iterator.__anext__()


async def wait(awaitable: Awaitable[T]) -> T:
    return await awaitable


_lock = threading.Lock()
_shared: tuple[int, LoopThread] | None = None


def shared() -> LoopThread:
    """This process's loop thread, started on first use."""
    global _shared
    with _lock:
        if _shared is None or _shared[0] != os.getpid():
            _shared = (os.getpid(), LoopThread())
        return _shared[1]
