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

Each call waits for the one started just before it on its connection, whose own turn
comes only after all the earlier ones': O(1) per call.

Concurrency: asyncio, on the server's event loop only (no locks).
"""

from __future__ import annotations

import asyncio


class Arrival:
    """One call's place among its connection's calls: ``wait`` before handing the first
    attempt to a thread, ``dispatched`` once it is handed (or when the call ends, however
    it ends; idempotent)."""

    __slots__ = ("_previous", "_turn", "_ended", "_passed")

    def __init__(self, previous: asyncio.Future | None, turn: asyncio.Future, ended) -> None:
        self._previous = previous  # done once every earlier call has had its turn
        self._turn = turn  # done once this call and every earlier one have had theirs
        self._ended = ended
        self._passed = False

    async def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the earlier calls; whether
        they all got there."""
        previous = self._previous
        if previous is None or previous.done():
            return True
        await asyncio.wait((previous,), timeout=None if timeout is None else max(timeout, 0.0))
        return previous.done()  # asyncio.wait never cancels it

    def dispatched(self) -> None:
        """This call has had its turn: the next one may go once the earlier ones have."""
        if self._passed:
            return
        self._passed = True
        previous = self._previous
        if previous is None or previous.done():
            self._finish()
        else:  # ended before its turn (an error, a cancellation): pass it on in order
            previous.add_done_callback(lambda _: self._finish())

    def _finish(self) -> None:
        if not self._turn.done():
            self._turn.set_result(None)
            self._ended(self._turn)

    def __enter__(self) -> "Arrival":
        return self

    def __exit__(self, *exc) -> None:
        self.dispatched()


class Arrivals:
    """Per (connection, kind), the turn of the call started last, until it is done."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], asyncio.Future] = {}

    def start(self, peer: str, kind: str) -> Arrival:
        """Register a call as it starts (before its first ``await``). O(1)."""
        key = (peer, kind)
        turn = asyncio.get_running_loop().create_future()
        previous = self._last.get(key)
        self._last[key] = turn
        return Arrival(previous, turn, lambda f: self._done(key, f))

    def _done(self, key: tuple[str, str], turn: asyncio.Future) -> None:
        if self._last.get(key) is turn:  # no later call on the connection: forget it
            del self._last[key]
