"""InsertBatcher: coalesce many small inserts from many asyncio tasks into few RPCs.

An agentic producer runs hundreds of environments in one event loop, each finishing a
trajectory now and then. One Insert per trajectory pays the server's fixed per-call cost
(decoding, validation, a thread hop: ~1 ms of engine work, several ms under load) every
time; Kafka's producers answer this with ``linger.ms``, and so does this class: rows
wait up to ``linger_s`` (or until ``max_rows``) and go out as one Insert.

Semantics per caller stay those of ``AsyncClient.insert``: a caller's rows are stored
all or none, and it gets back their item ids. A combined Insert that fails with
INVALID_ARGUMENT (one caller's bad rows) is retried one caller at a time, so a bad
producer never fails its neighbours; any other error reaches every caller of the batch.

>>> batcher = client.batcher("rollouts", linger_s=0.005)
>>> item_ids = await batcher.insert([{"traj_id": "a", ...}])
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Sequence

import grpc
import numpy as np
import pyarrow as pa

from . import _codec
from .merge import settle

if TYPE_CHECKING:
    from .aio import AsyncClient


class InsertBatcher:
    def __init__(self, client: "AsyncClient", table: str, *, linger_s: float = 0.005,
                 max_rows: int = 1024, timeout: float | None = None) -> None:
        if linger_s < 0 or max_rows < 1:
            raise ValueError("linger_s must be >= 0 and max_rows >= 1")
        self._client, self.table = client, table
        self.linger_s, self.max_rows, self.timeout = linger_s, max_rows, timeout
        self._pending: list[tuple[pa.Table, np.ndarray, asyncio.Future]] = []
        self._rows = 0
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()  # referenced until done (asyncio keeps weak refs)
        self.calls = 0  # Insert RPCs sent, retries included

    async def insert(self, data: Any, priorities: Sequence[float] | None = None) -> np.ndarray:
        """Queue rows for the next combined Insert; returns their item ids once stored."""
        schema = None if isinstance(data, (pa.Table, pa.RecordBatch)) else await self._client.schema(self.table)
        rows = _codec.to_arrow(data, schema)
        pr = np.ones(rows.num_rows) if priorities is None else np.asarray(priorities, dtype=np.float64)
        if pr.shape != (rows.num_rows,):
            raise ValueError(f"{len(pr)} priorities for {rows.num_rows} rows")
        done = asyncio.get_running_loop().create_future()
        self._pending.append((rows, pr, done))
        self._rows += rows.num_rows
        if self._rows >= self.max_rows:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.linger_s, self._flush)
        return await done

    async def flush(self) -> None:
        """Send what is queued now and wait for it."""
        waiting = [f for _, _, f in self._pending]
        self._flush()
        await asyncio.gather(*waiting, return_exceptions=True)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending, self._rows = self._pending, [], 0
        if batch:
            task = asyncio.ensure_future(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[pa.Table, np.ndarray, asyncio.Future]]) -> None:
        try:
            # One contiguous batch: the server conforms, validates and stores per record
            # batch, so many callers' one-row tables sent as they are cost it ~5x.
            combined = pa.concat_tables([rows for rows, _, _ in batch], promote_options="default").combine_chunks()
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # callers sent different column types
            await asyncio.gather(*(self._send([one]) for one in batch))
            return
        try:
            ids = await self._insert(combined, np.concatenate([pr for _, pr, _ in batch]))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and len(batch) > 1:
                await asyncio.gather(*(self._send([one]) for one in batch))  # find the bad caller
                return
            for _, _, done in batch:
                settle(done, error=e)
            return
        start = 0
        for rows, _, done in batch:
            settle(done, ids[start:start + rows.num_rows])
            start += rows.num_rows

    async def _insert(self, rows: pa.Table, priorities: np.ndarray) -> np.ndarray:
        self.calls += 1
        return (await self._client.insert(self.table, rows, priorities=priorities, timeout=self.timeout)).item_ids
