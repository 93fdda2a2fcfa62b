"""A client's calls are handed to the engine in the order the client started them.

A table admits blocked inserts and samples first come, first served (expstore/turns.py),
"first" meaning the order in which calls reach the table's lock. A producer that keeps
several inserts in flight (``Client.insert_future``, ``AsyncClient``) starts them in
order, but they then race: grpc may start the handlers of calls sent microseconds apart
in either order (a unary call's handler starts once its request is read), and each
call's validation runs on whichever engine thread is free.

So the client numbers its calls of each kind (metadata ``expstore-order``:
``ORIGIN:SEQ:LOW``, see ``order_of``): ``ORIGIN`` names the client's line of calls (a
random token), ``SEQ`` counts its calls from 0 as they start, and ``LOW`` is the lowest
``SEQ`` the client has not seen end yet: every call below it has ended and needs no
waiting for. A call hands its first attempt to an engine thread only once every call of
its line numbered below it has handed its own, ended, or been given up on; the table
then keeps that order between the threads (``Table.expect``). Only this hand-over is
ordered: receiving and validating the calls overlap. Other lines never wait for it.

A number that never arrives (a call that failed in the client or was refused before its
handler ran, while later ones were already on their way) is given up on after
``GAP_GRACE_S``: the calls behind it go on. grpc swaps calls started microseconds apart,
so a short grace keeps the order; it is the delay a lost call costs the calls behind it.
The grace counts time in which the event loop ran: a timer that fires late (the loop was
held up, say on a busy machine) starts the grace again, because the missing call may have
been received meanwhile and its handler may be queued behind the timer (seen once, with
two test suites sharing 2 cores: a producer's eighth blocked insert was admitted before
its fifth).
A call without the metadata (another client) is numbered on arrival among its
connection's calls (gRPC's ``context.peer()``), which orders all but calls started
microseconds apart.

A line is remembered while any of its calls runs and for ``IDLE_S`` after, so that the
next call finds the numbers of the last ones. Every operation is O(1) amortised.

Concurrency: asyncio, on the server's event loop only (no locks).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import OrderedDict
from typing import Callable, Sequence

from expstore.errors import InvalidArgument
from expstore_proto.service import ORDER_KEY

GAP_GRACE_S = 0.25  # how long a call waits for an earlier number that has not arrived
STALL_S = 0.02  # a grace timer this late means the loop stalled: calls may be queued behind the stall
IDLE_S = 60.0  # how long a line without running calls is remembered
MAX_ORIGIN_CHARS = 64


def order_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[str, int, int] | None:
    """The (origin, seq, low) a call's metadata names, or None if it names none. A value
    that is not ``ORIGIN:SEQ:LOW`` (origin of 1..64 characters, 0 <= LOW <= SEQ) is refused."""
    for key, value in metadata or ():
        if key != ORDER_KEY:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        origin, _, numbers = text.rpartition(":")
        origin, _, seq = origin.rpartition(":")
        try:
            seq_n, low_n = int(seq), int(numbers)
        except ValueError:
            seq_n = low_n = -1
        if not (0 < len(origin) <= MAX_ORIGIN_CHARS and 0 <= low_n <= seq_n):
            raise InvalidArgument(f"metadata {ORDER_KEY!r} must be ORIGIN:SEQ:LOW (an origin of 1 to "
                                  f"{MAX_ORIGIN_CHARS} characters, 0 <= LOW <= SEQ), got {text[:100]!r}")
        return origin, seq_n, low_n
    return None


class Line:
    """The numbered calls of one origin and kind: whose turn it is.

    ``frontier`` is the lowest number that has not had its turn: every call numbered
    below it has. A call's turn comes when the frontier reaches its number."""

    __slots__ = ("frontier", "next_local", "live", "touched", "_waiting", "_numbers", "_passed", "_gap", "_gap_at")

    def __init__(self, frontier: int = 0) -> None:
        self.frontier = frontier
        self.next_local = frontier  # the next number for calls that bring none
        self.live = 0  # calls of the line running on the server
        self.touched = time.monotonic()
        self._waiting: dict[int, asyncio.Future] = {}  # arrived, turn not had yet
        self._numbers: list[int] = []  # a heap of _waiting's numbers (and of some that left it)
        self._passed: set[int] = set()  # had their turn ahead of the frontier
        self._gap: asyncio.TimerHandle | None = None  # gives up on the number at _gap_at
        self._gap_at = -1

    def arrive(self, seq: int, on_end: Callable[["Line"], None] = lambda line: None) -> "Arrival":
        """Register call ``seq`` as it starts (before its first ``await``)."""
        turn = asyncio.get_running_loop().create_future()
        self.live += 1
        if seq < self.frontier or seq in self._waiting:  # given up on, or numbered twice: no waiting
            turn.set_result(None)
        else:
            self._waiting[seq] = turn
            heapq.heappush(self._numbers, seq)
            self._settle()
        return Arrival(self, seq, turn, on_end)

    def skip_to(self, low: int) -> None:
        """Every call numbered below ``low`` has ended at the client: wait for none of them
        (those still running here, which the client gave up on, wait for nothing either)."""
        if low > self.frontier:
            self._advance(low)

    def passed(self, seq: int) -> None:
        """Call ``seq`` has had its turn (or ended before it)."""
        self._waiting.pop(seq, None)
        if seq >= self.frontier:
            self._passed.add(seq)
            self._settle()

    def ended(self) -> None:
        """One of the line's calls has ended."""
        self.live -= 1
        self.touched = time.monotonic()

    def _settle(self) -> None:
        """Move the frontier past the numbers that had their turn; give the call at it its
        turn, or, if it has not arrived while later ones wait, give up on it in time."""
        while self.frontier in self._passed:
            self._passed.remove(self.frontier)
            self.frontier += 1
        while self._numbers and self._numbers[0] < self.frontier:  # had their turn: left _waiting
            heapq.heappop(self._numbers)
        turn = self._waiting.get(self.frontier)
        if turn is not None and not turn.done():
            turn.set_result(None)
        gap = turn is None and bool(self._waiting)
        if self._gap is not None and not (gap and self._gap_at == self.frontier):
            self._gap.cancel()
            self._gap = None
        if gap and self._gap is None:
            self._gap_at = self.frontier
            self._gap = asyncio.get_running_loop().call_later(GAP_GRACE_S, self._give_up)

    def _give_up(self) -> None:
        """The number at the frontier never came: the lowest waiting call goes next, unless
        the timer fired late (the loop stalled): then the grace starts again."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._gap.when() > STALL_S:
            self._gap = loop.call_later(GAP_GRACE_S, self._give_up)
            return
        self._gap = None
        if self._waiting and self.frontier not in self._waiting:
            self._advance(self._lowest_waiting())

    def _advance(self, frontier: int) -> None:
        """Move the frontier up to ``frontier``: the calls below it wait no more. Keeps
        ``_waiting`` and ``_passed`` to numbers at or above the frontier."""
        self.frontier = frontier
        while self._numbers and self._numbers[0] < frontier:
            turn = self._waiting.pop(heapq.heappop(self._numbers), None)
            if turn is not None and not turn.done():
                turn.set_result(None)
        self._passed = {s for s in self._passed if s >= frontier}
        self._settle()

    def _lowest_waiting(self) -> int:
        while self._numbers[0] not in self._waiting:  # left since: drop it
            heapq.heappop(self._numbers)
        return self._numbers[0]


class Arrival:
    """One call's place in its line: ``wait`` before handing the first attempt to a
    thread, ``dispatched`` once it is handed (or when the call ends, however it ends;
    idempotent). As a context manager, the call's whole life."""

    __slots__ = ("_line", "_seq", "_turn", "_on_end", "_passed")

    def __init__(self, line: Line, seq: int, turn: asyncio.Future, on_end: Callable[[Line], None]) -> None:
        self._line, self._seq, self._turn, self._on_end = line, seq, turn, on_end
        self._passed = False

    async def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the calls before it; whether
        they all had their turn."""
        if not self._turn.done():
            await asyncio.wait((self._turn,), timeout=None if timeout is None else max(timeout, 0.0))
        return self._turn.done()  # asyncio.wait never cancels it

    def dispatched(self) -> None:
        """This call has had its turn: the next one may go once the earlier ones have."""
        if not self._passed:
            self._passed = True
            self._line.passed(self._seq)

    def __enter__(self) -> "Arrival":
        return self

    def __exit__(self, *exc) -> None:
        self.dispatched()
        self._line.ended()
        self._on_end(self._line)


class Arrivals:
    """The lines of calls of every origin and kind, forgotten ``IDLE_S`` after their last
    call ended."""

    def __init__(self) -> None:
        self._lines: OrderedDict[tuple[str, str], Line] = OrderedDict()  # least recently touched first

    def start(self, kind: str, peer: str, order: tuple[str, int, int] | None) -> Arrival:
        """Register a call as it starts (before its first ``await``): ``order`` is what
        its metadata names (``order_of``), or None to number it among ``peer``'s calls."""
        self._forget_idle()
        key = (peer, kind) if order is None else (order[0], kind)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = Line(0 if order is None else order[2])
        self._lines.move_to_end(key)
        if order is None:
            seq, line.next_local = line.next_local, line.next_local + 1
        else:
            seq = order[1]
            line.skip_to(order[2])
        return line.arrive(seq, lambda line, key=key: self._ended(key, line))

    def _ended(self, key: tuple[str, str], line: Line) -> None:
        if self._lines.get(key) is line:
            self._lines.move_to_end(key)

    def _forget_idle(self) -> None:
        horizon = time.monotonic() - IDLE_S
        while self._lines:
            key, line = next(iter(self._lines.items()))
            if line.live or line.touched > horizon:
                return
            del self._lines[key]
