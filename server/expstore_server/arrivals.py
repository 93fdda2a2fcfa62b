"""Calls of one client connection are handed to the engine in the order they started.

A table admits blocked inserts and samples first come, first served (expstore/turns.py),
"first" meaning the order in which calls reach the table's lock. A producer that keeps
several inserts in flight (``Client.insert_future``, ``AsyncClient``) starts them in
order, but each then races: its messages are sent by a thread of their own, and its
validation runs on whichever engine thread is free. So a call hands its first attempt
to an engine thread only once every earlier-started call of the same kind from the same
connection (gRPC's ``context.peer()``) has handed its own (or ended); the table then
keeps that order between the threads (``Table.expect``). Only this hand-over is
ordered: receiving and validating the calls overlap. Calls of other connections never
wait for it: a client that opens an insert and never finishes sending it holds back
only its own later calls.

Concurrency: asyncio, on the server's event loop only (no locks).
"""

from __future__ import annotations

import asyncio


class Arrival:
    """One call's place among its connection's calls: ``wait`` before handing the first
    attempt to a thread, ``dispatched`` once it is handed (or when the call ends, however
    it ends; idempotent)."""

    __slots__ = ("_handed", "_earlier", "_release")

    def __init__(self, handed: asyncio.Future, earlier: list[asyncio.Future], release) -> None:
        self._handed = handed
        self._earlier = earlier
        self._release = release

    async def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the earlier calls; whether
        they all got there."""
        pending = [f for f in self._earlier if not f.done()]
        if pending:
            timeout = None if timeout is None else max(timeout, 0.0)
            _, pending = await asyncio.wait(pending, timeout=timeout)  # never cancels them
        return not pending

    def dispatched(self) -> None:
        if not self._handed.done():
            self._handed.set_result(None)
            self._release(self._handed)

    def __enter__(self) -> "Arrival":
        return self

    def __exit__(self, *exc) -> None:
        self.dispatched()


class Arrivals:
    """The calls in flight per (connection, kind) that have not been handed to the engine."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], list[asyncio.Future]] = {}

    def start(self, peer: str, kind: str) -> Arrival:
        """Register a call as it starts (before its first ``await``). O(calls in flight
        on the connection)."""
        key = (peer, kind)
        pending = self._pending.setdefault(key, [])
        handed = asyncio.get_running_loop().create_future()
        arrival = Arrival(handed, list(pending), lambda f: self._done(key, f))
        pending.append(handed)
        return arrival

    def _done(self, key: tuple[str, str], handed: asyncio.Future) -> None:
        pending = self._pending[key]
        pending.remove(handed)
        if not pending:
            del self._pending[key]
