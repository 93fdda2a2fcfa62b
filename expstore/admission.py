"""One blocking model: a call that may wait is a series of attempts and waits.

An insert, sample or stream read is made of *attempts*. An attempt (``Table.try_insert``,
``Table.try_sample``, ``Table.try_stream``) takes the table's lock once and either
completes the call or returns a ``Wait``: why the call cannot go on yet (the rate
limiter, the sampler, an empty stream, calls ahead of it in line) and, for a stream with
unacked items, when one of them falls due. The caller then waits for the table's next
change with a *waiter* of its own kind, and tries again:

- threads in process: ``Table.wait_for_change``, on the table's Condition (the blocking
  ``insert``/``sample``/``stream`` with a ``timeout``);
- the asyncio server: an asyncio event set by the table's ``subscribe`` listeners, so a
  thousand held-back producers cost a thousand coroutines, not a thousand threads.

``Admission`` is what both waiters share, written once: the deadline, the call's place
in its line (``turns.Turn``: blocked inserts and samples are admitted first come, first
served), counting a call that waited once in ``<op>_waits`` and its whole wait in
``<op>_wait_seconds``, and the DeadlineExceeded that says why the call waited.

Concurrency: an Admission belongs to one call; ``Table`` methods it calls take the
table's lock themselves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .errors import DeadlineExceeded
from .turns import Turn

if TYPE_CHECKING:
    from .table import Table


@dataclass(frozen=True)
class Wait:
    """An attempt that could not complete the call: wait for a change and try again.
    ``epoch``: the table's change count the attempt saw (a waiter that finds another
    one does not wait). ``retry_after``: try again after this many seconds at the latest
    even without a change (a stream's unacked item falls due)."""

    why: str
    epoch: int
    retry_after: float | None = None


class Admission:
    """The waiting state of one call (see the module docstring).

    >>> with Admission(table, "insert", timeout=5.0, turn=table.turn("insert")) as adm:
    ...     while isinstance(outcome := table.try_insert(prep, adm.turn), Wait):
    ...         table.wait_for_change(outcome.epoch, adm.limit(outcome))
    """

    def __init__(self, table: "Table", op: str, timeout: float | None, turn: Turn | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 leave: Callable[[Turn], None] | None = None) -> None:
        """``leave``: how the turn leaves the line at the end (default ``table.leave``;
        the server hands it to an engine thread, off its event loop)."""
        self.table, self.op, self.turn = table, op, turn
        self._clock = clock
        self._leave = leave or table.leave
        self.deadline = None if timeout is None else clock() + max(0.0, timeout)
        self._waiting_since: float | None = None

    def limit(self, wait: Wait) -> float | None:
        """How long to wait for a change after ``wait`` (None: no limit). Raises
        DeadlineExceeded saying why once the deadline has passed. The call's first wait
        is counted in the table's ``<op>_waits`` here, as it begins (observable)."""
        now = self._clock()
        if self.deadline is not None and now >= self.deadline:
            raise DeadlineExceeded(f"table {self.table.name!r}: {wait.why}", retry_after=wait.retry_after)
        if self._waiting_since is None:
            self._waiting_since = now
            self.table.record_wait(self.op)
        left = None if self.deadline is None else self.deadline - now
        if wait.retry_after is not None:
            left = wait.retry_after if left is None else min(left, wait.retry_after)
        return left

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc) -> None:
        """The call ends, however it ends: its turn leaves the line (an admitted one has
        already left), and the time it waited is counted."""
        if self.turn is not None and not self.turn.done:
            self._leave(self.turn)
        if self._waiting_since is not None:
            self.table.record_wait(self.op, self._clock() - self._waiting_since)
