"""First come, first served: the order in which a table admits its blocked calls.

Reverb keeps a table's pending inserts and pending sample requests in two queues and
serves each strictly in order (``reverb/cc/table.cc``, ``TableWorkerLoop``): a call that
arrives while others of its kind wait goes behind them, and the oldest holds back those
behind it until it is admitted, times out or is cancelled (head-of-line blocking: a
large batch at the head is not overtaken by a small one that would fit). A ``Line``
does the same for one table and one kind of call (inserts, samples): without it, every
waiter woken by a change would race for the table's lock and a producer's blocked
inserts could be applied out of order.

A call holds a ``Turn``. The turn joins the line the first time the call reaches the
table's lock, and leaves it when the call is admitted or ends (deadline, error,
cancellation). Only the turn at the head may be admitted; a call that finds nobody
waiting and can proceed never waits at all. Calls that never block (an insert of rows
that are all duplicates) pass without a turn's say.

Origins. The asyncio server starts the calls of one client connection (an *origin*)
on its engine threads in the order they started, but two threads may then race for the
lock. So it registers each turn with ``expect`` as it hands the call's first attempt to
a thread; a turn that reaches the lock while an earlier-registered turn of its origin
has not is *held*: it does not join the line yet, and its thread waits a moment for the
earlier one (which is running on another thread) rather than overtaking it. Turns with
no origin (in-process callers) are never held.

Locking: the table's lock guards the queue; ``expect`` runs on the server's event loop
and so must not take the table's lock, which it would share with long critical
sections: the origin registry has a lock of its own (taken inside the table's lock, and
alone by ``expect``; held for O(1) work). ``Turn.may_try`` is the one read made without
a lock (the server asks it before spending a thread hop on a call that cannot be
admitted); it reads one attribute, and a change that makes it true is followed by the
table's change notification.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Hashable


class Turn:
    """One call's place in a table's line (see the module docstring). ``line`` is None
    until the call first joins; ``origin`` is the client connection (None: none)."""

    __slots__ = ("op", "origin", "line", "done", "seq", "passed")

    def __init__(self, op: str, origin: Hashable | None = None) -> None:
        self.op = op
        self.origin = origin
        self.line: Line | None = None
        self.done = False
        self.seq = -1  # registration order among its origin's turns (-1: not registered)
        self.passed = False  # has passed its origin's order at the table's lock

    def may_try(self) -> bool:
        """Whether an attempt could succeed or end the call now: not in line yet, at its
        head, or the line is closed (the table is: every waiter fails at once)."""
        line = self.line
        return line is None or line.head is self or line.closed


class Line:
    """The waiting calls of one kind on one table, oldest first, and the registered
    calls of each origin that have not passed the table's lock yet."""

    def __init__(self) -> None:
        self._queue: deque[Turn] = deque()
        self.head: Turn | None = None
        self.closed = False  # the table is closed: its calls fail, in line or not
        self._waiting = 0
        self._origins_lock = threading.Lock()
        self._expected: dict[Hashable, deque[Turn]] = {}  # origin -> registered turns, in order
        self._next_seq = 0

    # -- origins ------------------------------------------------------------------

    def expect(self, turn: Turn) -> None:
        """Register a turn whose first attempt is being handed to a thread (call them in
        the order of the origin's calls). O(1)."""
        if turn.origin is None or turn.seq >= 0:
            return
        with self._origins_lock:
            turn.seq = self._next_seq
            self._next_seq += 1
            self._expected.setdefault(turn.origin, deque()).append(turn)

    def reach(self, turn: Turn) -> tuple[bool, bool]:
        """``turn`` is at the table's lock: (held, release). ``held``: an earlier-registered
        turn of its origin has not passed this point yet, so ``turn`` must not go on.
        Otherwise the turn passes for good (it joins the line, is admitted or ends before
        the lock is released), and ``release`` says whether later turns of its origin are
        registered (wake them: one may be held). O(1) amortised."""
        if turn.seq < 0 or turn.passed or turn.done:
            return False, False
        with self._origins_lock:
            expected = self._expected[turn.origin]
            while expected[0].passed or expected[0].done:
                expected.popleft()
            if expected[0] is not turn:
                return True, False
            turn.passed = True
            expected.popleft()
            while expected and (expected[0].passed or expected[0].done):
                expected.popleft()
            if not expected:
                del self._expected[turn.origin]
            return False, bool(expected)

    # -- the line -----------------------------------------------------------------

    def join(self, turn: Turn) -> None:
        """Put a turn at the back, unless it is in line already or has left (a call
        that gave up never gets back in). O(1)."""
        if turn.line is not None or turn.done:
            return
        turn.line = self
        self._queue.append(turn)
        self._waiting += 1
        if self.head is None:
            self.head = turn

    def first(self, turn: Turn) -> bool:
        """Whether ``turn`` is at the head (it may be admitted); joins it first. A turn
        that has left is never first. O(1)."""
        self.join(turn)
        return self.head is turn and not turn.done

    def ahead_of(self, turn: Turn) -> int:
        """Calls waiting ahead of ``turn`` (for error messages). O(position)."""
        n = 0
        for t in self._queue:
            if t is turn:
                break
            n += not t.done
        return n

    def leave(self, turn: Turn) -> bool:
        """Take a turn out of line and out of its origin's registered turns (admitted or
        given up; idempotent). Returns whether a waiter must be woken: the head changed,
        or a held turn of its origin may go on. Amortised O(1)."""
        if turn.done:
            return False
        turn.done = True
        wake = False
        if turn.seq >= 0 and not turn.passed:
            with self._origins_lock:
                wake = turn.origin in self._expected
        if turn.line is not self:
            return wake
        self._waiting -= 1
        if self.head is not turn:
            return wake
        queue = self._queue
        while queue and queue[0].done:
            queue.popleft()
        self.head = queue[0] if queue else None
        return wake or self.head is not None

    def __len__(self) -> int:
        """Calls waiting in line."""
        return self._waiting
