"""A paced table's Reserve and Release calls: the admission side of pacing.py.

``Pacing`` is the arithmetic (how many rows a policy version may still have in flight,
whose lease ends when); this is the call around it, as ``Table.try_insert`` is around the
rate limiter: in line first come, first served (gate.py), journaled (records.py
``Reserved``, ``ReservationReleased``) before it is applied, and the change announced.
Leases that ended are given back by ``expire`` on every call's tick (``Table.tick``), so
a lost producer never holds its rows for good. Kept apart from ``Table`` because only
paced tables have it; a table without pacing answers FAILED_PRECONDITION with the remedy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .admission import Admission, Wait
from .errors import FailedPrecondition
from .gate import Gate
from .pacing import Pacing, Reservation
from .records import ReservationReleased, Reserved
from .turns import Turn

if TYPE_CHECKING:
    from .table import Table


class Reservations:
    def __init__(self, table: "Table", gate: Gate, pacing: Pacing | None, clock: Callable[[], float]) -> None:
        self.table, self.gate, self.pacing = table, gate, pacing
        self._clock = clock  # times waits (``Table``'s clock); leases run on the table's wall clock

    def reserve(self, n: int, timeout: float | None, lease_s: float | None) -> Reservation:
        with Admission(self.table, "reserve", timeout, self.gate.turn("reserve"), self._clock) as adm:
            while isinstance(outcome := self.try_reserve(n, adm.turn, lease_s), Wait):
                self.gate.wait_for_change(outcome.epoch, adm.limit(outcome))
        return outcome

    def try_reserve(self, n: int, turn: Turn, lease_s: float | None) -> Reservation | Wait:
        t, pace = self.table, self._paced()
        pace.check(n, lease_s)
        with self.gate.lock:
            line = self.gate.lines["reserve"]
            if (held := self.gate.held(line, turn)) is not None:
                return held
            t.check_open()
            t.tick()
            if (ahead := self.gate.ahead(line, turn)) is not None:
                return ahead
            if not pace.can_grant(n, t.policy_version):
                deadline = pace.next_deadline()
                return Wait(pace.why(n, t.policy_version), self.gate.epoch,
                            retry_after=None if deadline is None else max(0.0, deadline - t.wall_clock()) + 1e-3)
            with self.gate.admitted(line, turn):
                r = pace.offer(n, t.policy_version, t.wall_clock(), lease_s)
                t.journal(Reserved(id=r.id, n=r.count, deadline=r.deadline, version=r.policy_version))
                pace.grant(r)
                t.changed()
            return r

    def release(self, reservation_id: int) -> int:
        t, pace = self.table, self._paced()
        rid = int(reservation_id)
        pace.check_release(rid)
        with self.gate.lock:
            t.check_open()
            t.tick()
            if rid not in pace:
                return 0
            t.journal(ReservationReleased(id=rid, reason="released"))
            freed = pace.release(rid)
            t.changed()
            return freed

    def expire(self) -> None:
        """Give back the unused rows of reservations whose lease ended (lock held)."""
        if self.pacing is None:
            return
        due = self.pacing.due(self.table.wall_clock())
        for rid in due:
            self.table.journal(ReservationReleased(id=rid, reason="expired"))
            self.pacing.release(rid, "expired")
        if due:
            self.table.changed()

    def _paced(self) -> Pacing:
        if self.pacing is None:
            raise FailedPrecondition(f"table {self.table.name!r} does not pace admission (create it with pacing = "
                                     f"{{rollouts_per_version = B}} and max_staleness)")
        return self.pacing
