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
table (under the table's lock), and leaves it when the call is admitted or ends
(deadline, error, cancellation). Only the turn at the head may be admitted; a call that
finds nobody waiting and can proceed never waits at all. Calls that never block (an
insert of rows that are all duplicates) pass without a turn's say.

Not thread-safe: the table holds its lock around ``join``, ``leave`` and the admission
check. ``Turn.may_try`` is the one read made without it (the asyncio server asks it
before spending a thread hop on a call that cannot be admitted); it reads one attribute,
and a change that makes it true is followed by the table's change notification.
"""

from __future__ import annotations

from collections import deque


class Turn:
    """One call's place in a table's line (see the module docstring). ``line`` is None
    until the call first reaches the table."""

    __slots__ = ("op", "line", "done")

    def __init__(self, op: str) -> None:
        self.op = op
        self.line: Line | None = None
        self.done = False

    def may_try(self) -> bool:
        """Whether an attempt could succeed or end the call now: not in line yet, at its
        head, or the line is closed (the table is: every waiter fails at once)."""
        line = self.line
        return line is None or line.head is self or line.closed


class Line:
    """The waiting calls of one kind on one table, oldest first."""

    def __init__(self) -> None:
        self._queue: deque[Turn] = deque()
        self.head: Turn | None = None
        self.closed = False  # the table is closed: its calls fail, in line or not
        self._waiting = 0

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
        """Take a turn out of line (admitted or given up; idempotent). Returns whether
        the head changed: the new head's call must be woken. Amortised O(1)."""
        if turn.done or turn.line is not self:
            turn.done = True
            return False
        turn.done = True
        self._waiting -= 1
        if self.head is not turn:
            return False
        queue = self._queue
        while queue and queue[0].done:
            queue.popleft()
        self.head = queue[0] if queue else None
        return self.head is not None

    def __len__(self) -> int:
        """Calls waiting in line."""
        return self._waiting
