"""Calls of one client connection reach a table in the order they started.

A table admits blocked inserts and samples first come, first served (expstore/turns.py),
"first" meaning the order in which calls reach the table's lock. A producer that keeps
several inserts in flight (``Client.insert_future``, ``AsyncClient``) starts them in
order, but each then races: its messages are sent by a thread of their own, and each
call's first attempt runs on whichever engine thread is free. So before a call's first
attempt at the table it waits for every earlier-started call of the same kind from the
same connection (gRPC's ``context.peer()``) to have made its own first attempt (joined
the table's line, or finished). Calls of other connections never wait for it: a client
that opens an insert and never finishes sending it holds back only its own later calls.

Concurrency: asyncio, on the server's event loop only (no locks).
"""

from __future__ import annotations

import asyncio


class Arrival:
    """One call's place among its connection's calls: ``wait`` before the first attempt,
    ``reached`` after it (or when the call ends, however it ends; idempotent)."""

    __slots__ = ("_reached", "_earlier", "_release")

    def __init__(self, reached: asyncio.Future, earlier: list[asyncio.Future], release) -> None:
        self._reached = reached
        self._earlier = earlier
        self._release = release

    def clear(self) -> bool:
        """Whether every earlier call has got there (``wait`` would not wait)."""
        return all(f.done() for f in self._earlier)

    async def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the earlier calls; whether
        they all got there."""
        pending = [f for f in self._earlier if not f.done()]
        if pending:
            timeout = None if timeout is None else max(timeout, 0.0)
            _, pending = await asyncio.wait(pending, timeout=timeout)  # never cancels them
        return not pending

    def reached(self) -> None:
        if not self._reached.done():
            self._reached.set_result(None)
            self._release(self._reached)

    def __enter__(self) -> "Arrival":
        return self

    def __exit__(self, *exc) -> None:
        self.reached()


class Arrivals:
    """The calls in flight per (connection, kind) that have not reached their table yet."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], list[asyncio.Future]] = {}

    def start(self, peer: str, kind: str) -> Arrival:
        """Register a call as it starts (before its first ``await``). O(calls in flight
        on the connection)."""
        key = (peer, kind)
        pending = self._pending.setdefault(key, [])
        reached = asyncio.get_running_loop().create_future()
        arrival = Arrival(reached, list(pending), lambda f: self._done(key, f))
        pending.append(reached)
        return arrival

    def _done(self, key: tuple[str, str], reached: asyncio.Future) -> None:
        pending = self._pending[key]
        pending.remove(reached)
        if not pending:
            del self._pending[key]
