"""Concurrent Insert calls to one table, committed together: one validation pass, one
chunk, one durable write.

A thousand producers each sending 8 rows cost the server a thousand validations (a fixed
cost per call: dozens of Arrow kernels whatever the rows), chunk writes and journal
records; measured at 1,000 producers, validation alone took a third of the server's CPU
and the durable writes under a tenth. So each table has a queue of the Insert calls whose
rows have arrived. One task per table drains it: it takes the calls at its head that can
share a chunk (the same durability and schema, up to ``max_rows`` rows and ``max_bytes``
Arrow bytes; at least one call) and commits them on one engine thread, as one
``prepare_insert`` and one ``try_insert``; each call then gets its own answer: its rows'
ids and counts, as if it had been committed alone. While a group is being committed the
next calls queue up, so groups grow with the load and a lone call waits for nobody.
Under a steady stream of calls (thousands of producers each sending now and then) the
commits are short, so few calls queue behind each and every group pays the commit's fixed
cost (~2.5 ms of engine CPU, which also takes the GIL from the event loop receiving the
calls): measured with 10,000 producers offering 1,590 calls a second, groups of 2-11
calls, and the server fell behind. So after a group of several calls, when fewer calls
than that group had are queued, the next group first waits for the rest of its crowd, as
PostgreSQL's ``commit_delay`` does when other transactions are active: until as many
calls as the last group had are queued, or ``delay_s`` (10 ms) has passed. A few
producers inserting back to back are all back within a round trip and go at once; a
stream of newcomers fills the wait and the groups grow. Measured against a fixed 2 ms
wait, alternating: 4 producers back to back 689-690 calls/s against 643-668; 1,000
producers of 3 calls 1,671-1,677 against 1,448-1,488; 10,000 producers offering 1,500
calls a second 1,284-1,314 against 1,154-1,217. (A fixed 10 ms wait did better on the
last two, 1,877-1,884 and 1,414-1,475, but cost 4 producers back to back a fifth of their
rate.) A lone producer never waits: its queue is empty after each call.
A unary call (InsertUnary) reaches the queue as soon as it is accepted, and a burst's
groups stayed small (10,000 producers at once: 11-14 calls a group, against ~350 when each
call was a stream whose handler first waited for its message), each paying the commit's
fixed cost. So a group that finds more calls queued than the last group had (a crowd
still growing: newcomers, not producers waiting on their answers) stays open while calls
keep coming, each within ``gap_s`` (1 ms) of the one before, for ``delay_s`` at most.
Producers back to back never queue more than their last group, so never wait for it.
Measured against no lingering, alternating, two runs each: 10,000 at once 1,695-1,753
calls/s against 1,612-1,632 (server CPU 0.53-0.54 ms a call against 0.58-0.60); 1,000
producers of 3 calls 1,788-1,951 against 1,715-1,769; 10,000 offering 2,127 calls/s p99
0.80-1.03 s against 1.25-1.31 s (offering 1,611: 103-142 ms against 152-269 ms); 4
producers back to back 911-974 calls/s against 935-950. A 2 ms gap cost those 4 a third.
Groups are committed one at a time, not pipelined: preparing the next group on a second
engine thread while one is written made inserts slower here, since the RocksDB write
holds the GIL (expstore/tiers/rocks.py, "Cost of a write").
A call's record batches become one (a copy of at most ``max_bytes``): a client's batcher
sends hundreds, each of which would otherwise be a chunk and a write of its own (measured,
one call of 125 x 8 rows: 200-260 ms prepared as sent, 7-16 ms as one batch).

A group of several calls whose rows fail validation together (a call's own rows are
bad, or two calls carry the same key: a client's retry) goes back to the head of the queue
and is taken again in halves, and so on: the calls that pass are still committed in
groups, and a bad call ends alone (a group of one is committed the ordinary way) with its
own error; before, the whole group went one by one, which a client's merged call of
hundreds of inserts (client/expstore_client/merge.py) with one retry in it made a
hundred commits. A group that cannot be committed whole for another reason (the rate
limiter holds the rows back, the disk is full, ...) is undone and its calls
committed one by one, in order, the ordinary way (``alone``), as is a group that finds
inserts already waiting in the table's line (it would only be undone): each gets exactly the answer
or error it would have got without coalescing, and a bad call fails alone while the
others land. A call that was alone in its group is already committed the ordinary way
(one ``prepare_insert``, then admission: waiting, if it must, for the rate limiter).

Order: a call joins the queue once the earlier calls of its connection have joined it
(arrivals.py), and the queue is committed in order, so a connection's calls reach the
table in the order they started. Calls into one table are admitted first come, first
served anyway (turns.py): a call the rate limiter holds back holds back those behind it.

Concurrency: asyncio, on the server's event loop; the commits run on the engine's threads.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np
import pyarrow as pa

from expstore.admission import Wait
from expstore.errors import DeadlineExceeded, ExpstoreError
from expstore.table import InsertResult, PreparedInsert, Table

from .arrivals import Arrival, Line

MAX_ROWS = 16384
MAX_BYTES = 8 << 20
DELAY_S = 0.010  # how long a group waits, at most, for the calls of a crowd that has not all queued yet
GAP_S = 0.001  # a growing crowd's group stays open while its calls keep coming at most this far apart


async def _until(crowd: asyncio.Future, timeout: float) -> None:
    """Wait until ``crowd`` is done or ``timeout`` seconds have passed (whichever first)."""
    await asyncio.wait((crowd,), timeout=timeout)


@dataclass
class Pending:
    """One Insert call waiting in its table's queue."""

    parts: list[pa.Table]
    priorities: np.ndarray
    durability: str | None
    nbytes: int  # the parts' Arrow bytes (decoding reads them: pa.Table.nbytes walks every buffer)
    # Commits the call the ordinary way (from its prepared rows if it has them), handing
    # its first attempt to the table in its arrival's order; calls ``tried`` once that
    # attempt has returned.
    alone: Callable[[PreparedInsert | None, Arrival, Callable[[], None]], Awaitable[InsertResult]]
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def rows(self) -> int:
        return len(self.priorities)

    @property
    def batches(self) -> int:
        return sum(p.num_rows and len(p.to_batches()) for p in self.parts)

    def mergeable(self) -> bool:
        """Whether this call's rows can be one record batch (its messages share a schema)."""
        schema = self.parts[0].schema
        return all(p.schema.equals(schema) for p in self.parts[1:])

    def joins(self, first: "Pending") -> bool:
        """Whether this call's rows can share a chunk with ``first``'s."""
        return self.durability == first.durability and self.mergeable() and \
            self.parts[0].schema.equals(first.parts[0].schema)


class InsertCoalescer:
    def __init__(self, run: Callable[..., Awaitable], max_rows: int = MAX_ROWS, max_bytes: int = MAX_BYTES,
                 delay_s: float = DELAY_S, gap_s: float = GAP_S,
                 wait: Callable[[asyncio.Future, float], Awaitable] = _until) -> None:
        self._run = run  # runs a function on an engine thread
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self.delay_s, self.gap_s, self._wait = delay_s, gap_s, wait
        self._queues: dict[Table, deque[Pending]] = {}
        self._crowds: dict[Table, tuple[int, asyncio.Future]] = {}  # awaited crowds: size, done once queued
        self.groups = 0  # groups of several calls committed whole (tests, benchmarks)

    async def insert(self, table: Table, call: Pending, arrival: Arrival, wait_s: float | None) -> InsertResult:
        """Queue a call behind its connection's earlier calls (``arrival``; waiting up to
        ``wait_s`` for them) and wait for its answer."""
        await self._queue(table, [call], arrival, wait_s)
        return await call.future

    async def insert_many(self, table: Table, calls: list[Pending], arrival: Arrival,
                          wait_s: float | None) -> list[InsertResult | BaseException]:
        """``insert`` of the inserts one call carries (``InsertRequest.parts``), queued
        together in their order: each one's answer, or its own error."""
        await self._queue(table, calls, arrival, wait_s)
        return await asyncio.gather(*(call.future for call in calls), return_exceptions=True)

    async def _queue(self, table: Table, calls: list[Pending], arrival: Arrival, wait_s: float | None) -> None:
        if not await arrival.wait(wait_s):
            raise DeadlineExceeded(f"table {table.name!r}: an earlier insert of this connection was still "
                                   f"being received or validated at the call's deadline")
        arrival.dispatched()
        queue = self._queues.get(table)
        if queue is None:
            queue = self._queues[table] = deque()
            asyncio.get_running_loop().create_task(self._drain(table, queue))
        queue.extend(calls)
        crowd = self._crowds.get(table)
        if crowd is not None and len(queue) >= crowd[0] and not crowd[1].done():
            crowd[1].set_result(None)

    async def _drain(self, table: Table, queue: deque[Pending]) -> None:
        try:
            last = 0  # calls in the group committed last
            cap = None  # calls the next group takes at most: half a group that failed validation
            while queue:
                if len(queue) < last and self.delay_s > 0:  # its crowd is still arriving (never after a group of one)
                    await self._gather(table, last, self.delay_s)
                elif 0 < last < len(queue) and self.gap_s > 0:  # more than the last group: newcomers, still coming?
                    await self._linger(table, queue)
                group = self._take(table, queue, cap)
                last, cap = len(group), None
                if not group:  # their callers have gone
                    continue
                try:
                    results = await self._run(self._commit, table, group)
                except Exception as e:  # noqa: BLE001 - a lone call's own error (or a fault)
                    for call in group:
                        _settle(call.future, exception=e)
                    continue
                if results is _INVALID:  # in halves, until the bad calls are alone
                    queue.extendleft(reversed(group))
                    cap = len(group) // 2
                    continue
                if isinstance(results, list):
                    for call, result in zip(group, results):
                        _settle(call.future, result)
                    continue
                prep = results  # a group of one held back (a PreparedInsert), or None
                await self._one_by_one(group, prep)
        finally:
            del self._queues[table]
            for call in queue:  # the server is stopping
                call.future.cancel()

    async def _gather(self, table: Table, size: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for ``size`` calls to be queued."""
        crowd = asyncio.get_running_loop().create_future()
        self._crowds[table] = (size, crowd)
        try:
            await self._wait(crowd, timeout)
        finally:
            del self._crowds[table]

    async def _linger(self, table: Table, queue: deque[Pending]) -> None:
        """Keep a growing crowd's group open while its calls keep coming, each within
        ``gap_s`` of the one before, for ``delay_s`` at most or until a group's rows are
        queued."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.delay_s
        while (left := end - loop.time()) > 0 and sum(call.rows for call in queue) < self.max_rows:
            size = len(queue) + 1
            await self._gather(table, size, min(self.gap_s, left))
            if len(queue) < size:
                return

    async def _one_by_one(self, group: list[Pending], prep: PreparedInsert | None) -> None:
        """Commit a group's calls the ordinary way, each handing its first attempt to the
        table after the one before it (a ``Line`` of their own); return once each has made
        its first attempt (so that a call held back is in the table's line before the
        next group tries) or ended. They wait, if they must, side by side in the line."""
        loop = asyncio.get_running_loop()
        line, tried = Line(), []
        for seq, call in enumerate(c for c in group if not c.future.done()):  # not those whose caller has gone
            arrival = line.arrive(seq)
            first = loop.create_future()
            task = loop.create_task(call.alone(prep, arrival, lambda first=first: _settle(first)))
            task.add_done_callback(functools.partial(_ended, call, arrival, first))
            call.future.add_done_callback(lambda f, task=task: task.cancel() if f.cancelled() else None)
            tried.append(first)
        if tried:
            await asyncio.wait(tried)

    def _prepare(self, table: Table, group: list[Pending]) -> PreparedInsert | None:
        """(An engine thread.) The group's rows prepared as one record batch, one chunk (a
        copy of at most max_bytes of rows, which saves a chunk and a write per record
        batch sent: a client's batcher sends hundreds); or None if they fail validation
        that way. A call that cannot be one batch (messages of different schemas, or more
        than max_bytes) is prepared as it was sent; its errors are raised (its own)."""
        first = group[0]
        if len(group) == 1 and not (first.mergeable() and first.batches > 1 and first.nbytes <= self.max_bytes):
            return table.prepare_insert(first.parts, first.priorities, first.durability)
        merged = pa.concat_tables([p for c in group for p in c.parts]).combine_chunks()
        priorities = np.concatenate([c.priorities for c in group])
        try:
            return table.prepare_insert([merged], priorities, first.durability)
        except ExpstoreError:
            if len(group) > 1:
                return None  # each call validated again as it was sent: its own error
            return table.prepare_insert(first.parts, first.priorities, first.durability)

    def _take(self, table: Table, queue: deque[Pending], cap: int | None = None) -> list[Pending]:
        group = [queue.popleft()]
        rows, nbytes = group[0].rows, group[0].nbytes
        while queue and group[0].mergeable() and queue[0].joins(group[0]) and rows + queue[0].rows <= self.max_rows \
                and nbytes + queue[0].nbytes <= self.max_bytes and (cap is None or len(group) < cap):
            call = queue.popleft()
            rows, nbytes = rows + call.rows, nbytes + call.nbytes
            group.append(call)
        return [c for c in group if not c.future.done()]

    def _commit(self, table: Table, group: list[Pending]) -> list[InsertResult] | PreparedInsert | object | None:
        """(An engine thread.) The answers of the group's calls; ``_INVALID`` where their
        rows fail validation together (taken again in halves); or, if the group cannot be
        committed whole otherwise, what the calls are then committed from one by one: None
        (from their rows), or the prepared rows of a lone call the rate limiter holds back.
        A lone call's error is raised: it is the call's own."""
        alone = len(group) == 1
        if not alone and table.in_line("insert"):  # held back anyway: go behind them one by one
            return None
        prep = self._prepare(table, group)
        if prep is None:
            return _INVALID
        turn = table.turn("insert")
        try:
            outcome = table.try_insert(prep, turn)
        except ExpstoreError:
            table.abandon_insert(prep)
            if alone:
                raise
            return None
        except BaseException:
            table.abandon_insert(prep)
            raise
        finally:
            table.leave(turn)
        if isinstance(outcome, Wait):
            if alone:
                return prep
            table.abandon_insert(prep)
            return None
        if alone:
            return [outcome]
        self.groups += 1
        return split(outcome, [c.rows for c in group])


_INVALID = object()  # what _commit answers for a group whose rows fail validation together


def split(result: InsertResult, rows: list[int]) -> list[InsertResult]:
    """The answer of each call whose rows (``rows[i]`` of them, in order) were committed
    together as ``result``."""
    out, lo = [], 0
    for n in rows:
        inserted, stale = result.inserted[lo:lo + n], result.stale[lo:lo + n]
        k = int(inserted.sum())
        out.append(InsertResult(result.item_ids[lo:lo + n], k, n - k, int(stale.sum()), inserted, stale))
        lo += n
    return out


def _ended(call: Pending, arrival: Arrival, first: asyncio.Future, task: asyncio.Task) -> None:
    """A call committed one by one has ended: answer it; the next may go."""
    arrival.dispatched()
    _settle(first)
    if task.cancelled():
        call.future.cancel()
    elif task.exception() is not None:
        _settle(call.future, exception=task.exception())
    else:
        _settle(call.future, task.result())


def _settle(future: asyncio.Future, result=None, exception: BaseException | None = None) -> None:
    if future.done():
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)
