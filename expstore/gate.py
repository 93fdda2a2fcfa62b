"""A table's gate: its one lock, its change notifications and its lines of blocked calls.

Every call that may wait (insert, sample, reserve, stream) is an attempt that never
blocks, repeated by a waiter (admission.py) until it is admitted. The gate is what those
attempts share, apart from the table's data: the ``threading.Condition`` that guards all
of the table's state, the change count (``epoch``) a ``Wait`` carries so that a waiter
never sleeps through a change it has not seen, the ``subscribe`` listeners (the asyncio
server's waiter), and one first-come-first-served ``Line`` per kind of blocking call
(turns.py). Kept apart from ``Table`` so that the admission mechanics read in one place
and the table reads as what it does to items.

Locking: ``held``, ``admitted``, ``wake`` and ``ahead`` are called with ``lock`` held;
``leave``, ``wait_for_change``, ``subscribe`` and ``close`` take it; ``expect`` never
does (it runs on the server's event loop, see turns.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator

from .admission import Wait
from .errors import InvalidArgument, Unavailable
from .turns import Line, Turn

WHAT = {"insert": "inserts", "sample": "samples", "reserve": "reservations"}  # in "Wait" messages


class Gate:
    def __init__(self, table: str) -> None:
        self.table = table
        self.lock = threading.Condition()
        self.lines = {op: Line() for op in WHAT}  # blocked calls, first come first served
        self.epoch = 0  # changes so far: a waiter that saw an older count does not wait
        self.closed = False
        self._listeners: list[Callable[[], None]] = []

    def turn(self, op: str, origin: Hashable | None = None) -> Turn:
        """A place in line for one blocking call (``Table.turn``)."""
        if op not in self.lines:
            raise InvalidArgument(f"table {self.table!r}: no line for {op!r} calls")
        return Turn(op, origin)

    def expect(self, turn: Turn) -> None:
        """Register a turn as its first attempt is handed to an engine thread, in the
        order of its origin's calls (see turns.py). Never takes the lock."""
        self.lines[turn.op].expect(turn)

    def leave(self, turn: Turn) -> None:
        """End a call's turn (idempotent); the call behind it, if any, is woken."""
        with self.lock:
            if self.lines[turn.op].leave(turn):
                self.wake()

    def wait_for_change(self, epoch: int, limit: float | None) -> None:
        """Block this thread until a change after ``epoch`` (a ``Wait``'s), or for
        ``limit`` seconds (None: no limit)."""
        with self.lock:
            if self.epoch == epoch:
                self.lock.wait(limit)

    def held(self, line: Line, turn: Turn) -> Wait | None:
        """A ``Wait`` if an earlier call of the turn's connection was handed to an engine
        thread before it and has not reached the lock yet: the attempt must not overtake
        it. The earlier call wakes it as it passes (or leaves)."""
        held, released = line.reach(turn)
        if released:
            self.wake()  # a held call of its connection may go on
        if held:
            return Wait(f"an earlier {turn.op} of this connection has not reached the table", self.epoch)
        return None

    def ahead(self, line: Line, turn: Turn) -> Wait | None:
        """A ``Wait`` while earlier calls of the turn's kind are waiting: head-of-line
        order, as Reverb serves its queues (turns.py)."""
        if line.first(turn):
            return None
        return Wait(f"{line.ahead_of(turn)} earlier {WHAT[turn.op]} are waiting (first come, first served)",
                    self.epoch)

    @contextmanager
    def admitted(self, line: Line, turn: Turn) -> Iterator[None]:
        """Leave the line as the call is admitted. The call's own change notification
        wakes the next in line; if the call fails instead, wake it here."""
        head_changed = line.leave(turn)
        try:
            yield
        except BaseException:
            if head_changed:
                self.wake()
            raise

    def check_open(self) -> None:
        if self.closed:
            raise Unavailable(f"table {self.table!r} is closed")

    def wake(self) -> None:
        """Wake every waiter, in-process threads and ``subscribe`` listeners alike."""
        self.epoch += 1
        self.lock.notify_all()
        for listener in self._listeners:
            listener()

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change (under the lock: it must not block)."""
        with self.lock:
            self._listeners.append(listener)

    def close(self) -> None:
        """Refuse later calls and end every line (lock held); the caller wakes the waiters."""
        self.closed = True
        for line in self.lines.values():
            line.closed = True

    def waiting(self, *ops: str) -> dict[str, int]:
        """How many calls wait in each line named (stats; ``Table.in_line``: a glance, no lock)."""
        return {op: len(self.lines[op]) for op in ops}
