"""Admission-paced staleness: producers reserve before they start a rollout.

Evicting staleness (``max_staleness`` alone) removes rows that come back more than
``max_staleness`` policy versions late. Long rollouts (an agent's 60-minute tool episode)
are the ones that come back late, so eviction trains on short tasks more than their share
(tinker-cookbook#822, citing Magistral). A table with ``pacing`` instead bounds how far
the producers may run ahead of the trainer, at the start of a rollout, and discards
nothing for lateness (AReaL's ``max_head_offpolicyness``).

The arithmetic, with ``B = pacing.rollouts_per_version`` (the rows the trainer consumes
per policy version), ``s = max_staleness`` and ``v`` the table's policy version::

    admitted + n <= (v + s + 1) * B       a reservation of n rows is granted

``admitted`` counts every row ever reserved, less the unused rows of reservations that
were released or whose lease expired, plus the rows inserted beyond (or without a live)
reservation. A trainer at version ``v`` has consumed about ``v * B`` rows, so at most
``(s + 1) * B`` rows are in flight or waiting to be trained, for any number of producers:
a row started at version ``v`` is trained by version ``v + s`` when rows are consumed in
the order they were started. A long rollout that returns later than that is still stored
and trained: it held its place in the pace (the trainer could not run ahead of the
in-flight window), which is what keeps the share of long tasks trained equal to their share
started. A reservation wider than ``(s + 1) * B`` could never be granted and is refused.

A reservation is settled by the rows that name it in the ``reservation_id`` column (up to
its count; it may take several inserts), released unused by ``release``, or expires at
its lease's end (wall clock), so a producer that dies does not hold capacity. Rows that
name a reservation no longer live (its lease expired: the rollout outlived it) are stored
all the same and charged anew (``pacing_late_rows``); rows without one are refused, and so
are ids never granted.

Durability: grants, releases and expiries are journaled by the table, and the rows an
insert settles are in its journal record, so a restart restores every live reservation
with its lease (leases that ended while the server was down expire at its first call).

Memory: the live reservations (each holds rows the pace admitted), O(log n) a change.
Not thread-safe: the table holds its lock. No clocks: callers pass the wall-clock time.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .errors import InvalidArgument, NotFound

COLUMN = "reservation_id"
ARROW_TYPE = pa.uint64()


@dataclass(frozen=True)
class Reservation:
    """A grant to start rollouts of ``count`` rows: ``id`` goes in their
    ``reservation_id`` column; the lease ends at ``deadline`` (Unix seconds)."""

    id: int
    count: int
    deadline: float
    policy_version: int


class Pacing:
    def __init__(self, rollouts_per_version: int, max_staleness: int, lease_s: float, table: str,
                 counters: Counter | None = None) -> None:
        """``counters``: where the ``pacing_*`` event counts go (the table's, so that they
        start from zero after a restart as its others do)."""
        self.per_version, self.bound, self.lease_s = rollouts_per_version, max_staleness, lease_s
        self.table = table
        self.admitted = 0
        self.next_id = 1
        self._left: dict[int, int] = {}  # live reservation id -> rows not yet inserted
        self._deadline: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []  # (deadline, id); entries of settled ids skipped
        self.counters: Counter[str] = Counter() if counters is None else counters

    # -- arithmetic ------------------------------------------------------------------

    @property
    def window(self) -> int:
        """The most rows in flight or untrained at once: ``(s + 1) * B``."""
        return (self.bound + 1) * self.per_version

    def limit(self, version: int) -> int:
        return (version + self.bound + 1) * self.per_version

    def can_grant(self, n: int, version: int) -> bool:
        return self.admitted + n <= self.limit(version)

    def check(self, n: int, lease_s: float | None) -> None:
        """InvalidArgument for a reservation that could never be granted."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"table {self.table!r}: a reservation is for >= 1 rows, got {n!r}")
        if n > self.window:
            raise InvalidArgument(
                f"table {self.table!r}: a reservation of {n} rows can never be granted: at most "
                f"(max_staleness + 1) * pacing.rollouts_per_version = {self.window} rows are in flight")
        if lease_s is not None and not (lease_s > 0 and lease_s < float("inf")):
            raise InvalidArgument(f"table {self.table!r}: lease_s must be a finite number of seconds > 0, "
                                  f"got {lease_s!r}")

    def why(self, n: int, version: int) -> str:
        """Why a reservation of n waits (the Wait and DeadlineExceeded message)."""
        return (f"pacing: a reservation of {n} rows waits for the trainer: {self.admitted} rows admitted, "
                f"{self.limit(version)} allowed at policy version {version} "
                f"((version + max_staleness + 1) * {self.per_version}), {len(self._left)} reservations live")

    # -- changes (the table journals each before applying it) ------------------------

    def offer(self, n: int, version: int, now: float, lease_s: float | None) -> Reservation:
        """The reservation a grant would make (not applied: ``grant`` does)."""
        return Reservation(self.next_id, n, now + (self.lease_s if lease_s is None else lease_s), version)

    def grant(self, r: Reservation) -> None:
        self.next_id = max(self.next_id, r.id + 1)
        self.admitted += r.count
        self._left[r.id] = r.count
        self._deadline[r.id] = r.deadline
        heapq.heappush(self._heap, (r.deadline, r.id))
        self.counters["pacing_reservations"] += 1
        self.counters["pacing_reserved_rows"] += r.count

    def settle(self, ids: np.ndarray) -> None:
        """Rows were inserted naming these reservations (one id per row)."""
        if len(ids) == 0:
            return
        unique, counts = np.unique(np.asarray(ids, np.uint64), return_counts=True)
        for rid, k in zip(unique.tolist(), counts.tolist()):
            left = self._left.get(rid, 0)
            taken = min(k, left)
            if rid in self._left:
                if left == taken:
                    self._drop(rid)
                else:
                    self._left[rid] = left - taken
            self.admitted += k - taken  # beyond the reservation, or it is gone: charged anew
            self.counters["pacing_settled_rows"] += taken
            self.counters["pacing_late_rows"] += k - taken

    def release(self, rid: int, reason: str = "released") -> int:
        """Give back a live reservation's unused rows (0 if it is no longer live)."""
        left = self._left.get(rid)
        if left is None:
            return 0
        self._drop(rid)
        self.admitted -= left
        self.counters[f"pacing_{reason}_rows"] += left
        return left

    def due(self, now: float) -> list[int]:
        """Live reservations whose lease ended at or before ``now``."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            deadline, rid = heapq.heappop(self._heap)
            if self._deadline.get(rid) == deadline:
                out.append(rid)
        return out

    def next_deadline(self) -> float | None:
        while self._heap and self._deadline.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def __contains__(self, rid: int) -> bool:
        """Whether a reservation is live (granted, not settled, released or expired)."""
        return rid in self._left

    def _drop(self, rid: int) -> None:
        del self._left[rid]
        del self._deadline[rid]
        if len(self._heap) > 2 * len(self._deadline) + 64:  # settled entries: keep the heap O(live)
            self._heap = [(d, r) for r, d in self._deadline.items()]
            heapq.heapify(self._heap)

    # -- validation of inserted rows --------------------------------------------------

    def check_rows(self, column: pa.ChunkedArray | pa.Array, row_offset: int) -> np.ndarray:
        """The rows' reservation ids (uint64); InvalidArgument naming the row for a null
        (the row was started without a reservation) or an id never granted."""
        ids = column.fill_null(0).to_numpy(zero_copy_only=False).astype(np.uint64)
        bad = np.flatnonzero(ids == 0)
        if len(bad):
            raise InvalidArgument(
                f"table {self.table!r}: row {row_offset + int(bad[0])}, column {COLUMN!r}: the table paces "
                f"admission (pacing): reserve before starting a rollout (Reserve) and put the reservation's "
                f"id in {COLUMN!r}")
        unknown = np.flatnonzero(ids >= self.next_id)  # next_id only grows: safe outside the lock
        if len(unknown):
            i = int(unknown[0])
            raise InvalidArgument(f"table {self.table!r}: row {row_offset + i}, column {COLUMN!r}: no reservation "
                                  f"{int(ids[i])} was granted")
        return ids

    def check_release(self, rid: int) -> None:
        if not 1 <= rid < self.next_id:
            raise NotFound(f"table {self.table!r}: no reservation {rid} was granted")

    # -- stats and persistence --------------------------------------------------------

    def stats(self, version: int) -> dict[str, float]:
        s = {"pacing_admitted": self.admitted, "pacing_limit": self.limit(version),
             "pacing_live_reservations": len(self._left), "pacing_unused_rows": sum(self._left.values())}
        for k in ("pacing_reservations", "pacing_reserved_rows", "pacing_settled_rows", "pacing_late_rows",
                  "pacing_released_rows", "pacing_expired_rows"):
            s[k] = self.counters[k]
        return s

    def state(self) -> dict:
        """For snapshots: the counters that survive a restart and the live reservations."""
        ids = sorted(self._left)
        return {"admitted": self.admitted, "next_id": self.next_id,
                "live": [[i, self._left[i], self._deadline[i]] for i in ids]}

    def load(self, state: dict) -> None:
        self.admitted, self.next_id = int(state["admitted"]), int(state["next_id"])
        for rid, left, deadline in state["live"]:
            self._left[int(rid)], self._deadline[int(rid)] = int(left), float(deadline)
            heapq.heappush(self._heap, (float(deadline), int(rid)))
