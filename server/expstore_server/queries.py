"""Where Query RPCs run: threads of their own, a bounded number at a time.

A query can compute for minutes and use gigabytes; inserts and samples must never wait
behind one. Queries run on ``query_workers`` threads that nothing else uses (the engine
pool stays free), at most ``query_workers + query_queue`` are open at once (running,
waiting for a thread, or streaming to their reader), and one more is refused at once
with RESOURCE_EXHAUSTED. Each query has its own DuckDB within ``expstore.query.Limits``
(time, memory, spill, threads); the servicer closes it, interrupting DuckDB, when its
client goes away. Admission is counted under a lock (the Flight service's threads
admit queries too).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from expstore import query
from expstore.errors import ResourceExhausted


class QueryRunner:
    def __init__(self, workers: int, queue: int, limits: query.Limits) -> None:
        self.limits = limits
        self._capacity = workers + queue
        self._open = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="query")
        if limits.temp_root is not None:  # spill directories of queries a killed server left
            query.remove_leftover_temp(limits.temp_root)

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Hold one of the open-query places for the duration of a Query call."""
        with self._lock:
            if self._open >= self._capacity:
                raise ResourceExhausted(f"{self._open} queries are open, the most this server runs at once "
                                        "(query_workers + query_queue); retry when one has finished")
            self._open += 1
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1

    async def run(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
