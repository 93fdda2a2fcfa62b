"""Group timeouts: a GRPO group that does not complete in time is released or dropped.

One slow member (a 60-minute tool rollout, a crashed environment) would otherwise hold
its group out of training forever (NeMo-RL#3238). With ``group_timeout_s`` (and the group
sampler), each group gets a deadline the moment its first member is stored: that
member's ``inserted_at`` (wall clock) plus ``group_timeout_s``. A group still *forming*
at its deadline (fewer than ``group_size`` members arrived, none lost) times out:

- ``group_timeout_action = "release"``: it becomes eligible with the members it has. Its
  rows read back (samples, Get, streams, queries) with ``group_size`` corrected to the
  number that arrived and ``group_released_partial`` true (false on every other row), so
  a trainer's group statistics use the right n. A batch of the group sampler holds
  ``batch_size / group_size`` groups, so with released groups it has fewer rows.
  ``drop_zero_variance`` applies to the released members as to complete groups.
- ``"drop"``: its members are removed (``removed_group_timeout``).

Either way the group is settled: a member that arrives after its group timed out is
acknowledged (it gets an id, and counts for deduplication) but never stored for
sampling (``removed_group_late``), like a row too stale to store. Groups that complete
in time, and groups that lost a member before their deadline (broken: never eligible,
as without timeouts), are not touched.

Timeouts fire lazily, under the table lock, at the next insert, sample, get, scan or
stats call after the deadline; a sample waiting for complete groups wakes up at the next
deadline (so a group sampler is never wedged by a straggler). Each timeout is journaled
(the group ids and the action) before it is applied, and replayed in order after a
restart; deadlines come from the journaled arrival times, so a restart neither extends
nor shortens them (deadlines that passed while the server was down fire at its first
call).

State: per group code, the first arrival time while the group is pending (a heap of
deadlines), and the outcome (released or dropped) of every group that timed out: one
byte per group code ever seen. Not thread-safe: the table holds its lock.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .records import GroupsTimedOut

if TYPE_CHECKING:
    from .parts import Parts
    from .table import Table

COLUMN = "group_released_partial"
PENDING, RELEASED, DROPPED = 0, 1, 2


class GroupTimeouts:
    def __init__(self, timeout_s: float, action: str) -> None:
        self.timeout_s = float(timeout_s)
        self.action = action
        self._first: dict[int, float] = {}  # group code -> first arrival (wall clock), while pending
        self._heap: list[tuple[float, int]] = []  # (deadline, code); stale entries skipped
        self._outcome = np.zeros(0, np.int8)  # by group code

    def arrived(self, codes: np.ndarray, at: np.ndarray) -> None:
        """Stored members (group codes, -1: none) and their arrival times, in arrival
        order: a group's clock starts at its first member."""
        seen = codes >= 0
        codes, at = codes[seen], at[seen]
        if len(codes) == 0:
            return
        _, first = np.unique(codes, return_index=True)
        for code, t in zip(codes[first].tolist(), at[first].tolist()):
            if code not in self._first and not self._settled(code):
                self._first[code] = t
                heapq.heappush(self._heap, (t + self.timeout_s, code))

    def due(self, now: float) -> np.ndarray:
        """Codes of pending groups whose deadline is <= ``now``; they stop being pending."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            deadline, code = heapq.heappop(self._heap)
            if self._first.get(code) is not None and self._first[code] + self.timeout_s == deadline:
                del self._first[code]
                out.append(code)
        return np.array(out, np.int64)

    def next_deadline(self) -> float | None:
        """The earliest pending deadline (wall clock), if any."""
        while self._heap and self._heap[0][1] not in self._first:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def settle(self, codes: np.ndarray, action: str) -> None:
        """Record that these groups timed out (released or dropped)."""
        if len(codes) == 0:
            return
        top = int(codes.max()) + 1
        if top > len(self._outcome):
            grown = np.zeros(max(top, 2 * len(self._outcome), 16), np.int8)
            grown[:len(self._outcome)] = self._outcome
            self._outcome = grown
        self._outcome[codes] = RELEASED if action == "release" else DROPPED
        for code in codes.tolist():
            self._first.pop(code, None)

    def settled(self, codes: np.ndarray) -> np.ndarray:
        """bool per code (-1: no group): whether its group timed out."""
        return self._lookup(codes) != PENDING

    def released(self, codes: np.ndarray) -> np.ndarray:
        """bool per code: whether its group was released partial."""
        return self._lookup(codes) == RELEASED

    def codes(self, outcome: int) -> np.ndarray:
        return np.flatnonzero(self._outcome == outcome)

    def _settled(self, code: int) -> bool:
        return code < len(self._outcome) and self._outcome[code] != PENDING

    def _lookup(self, codes: np.ndarray) -> np.ndarray:
        codes = np.asarray(codes, np.int64)
        ok = (codes >= 0) & (codes < len(self._outcome))
        out = np.zeros(len(codes), np.int8)
        out[ok] = self._outcome[codes[ok]]
        return out

    def state(self, name) -> dict:
        """For snapshots: group names (``name(code)``) with their first arrival, and outcomes."""
        return {"pending": {name(c): t for c, t in self._first.items()},
                "released": [name(c) for c in self.codes(RELEASED).tolist()],
                "dropped": [name(c) for c in self.codes(DROPPED).tolist()]}

    def load(self, state: dict, code) -> None:
        """The inverse of ``state`` (``code(name)``: the group's code)."""
        for outcome, action in (("released", "release"), ("dropped", "drop")):
            self.settle(np.array([code(n) for n in state[outcome]], np.int64), action)
        for n, t in state["pending"].items():
            c = code(n)
            self._first[c] = float(t)
            heapq.heappush(self._heap, (float(t) + self.timeout_s, c))


class GroupTimer:
    """Fires a table's group timeouts: journals each that fell due and applies it (the
    sampler lets the groups go, the index corrects ``group_size``, the table removes what
    is dropped). Apart from ``GroupTimeouts`` (the deadlines) because it acts on the
    table's parts; apart from ``Table`` because only tables with group timeouts have it.
    Every method runs with the table's lock held."""

    def __init__(self, table: "Table", parts: "Parts", action: str, counters: Counter[str]) -> None:
        self.table, self.action, self.counters = table, action, counters
        self.timeouts, self.sampler, self.groups, self.index = parts.timeouts, parts.sampler, parts.groups, parts.index

    def tick(self) -> None:
        """Time out the forming groups whose deadline passed (the others completed in
        time, or broke): journaled, then applied."""
        if self.timeouts is None:
            return
        due = self.timeouts.due(self.table.wall_clock())
        if len(due) == 0:
            return
        forming = self.sampler.forming(due)
        if len(forming):
            self.table.journal(GroupsTimedOut(groups=[self.groups.name(c) for c in forming.tolist()],
                                              action=self.action))
            self.settle(forming, self.action)
            self.table.changed()

    def settle(self, codes: np.ndarray, action: str) -> None:
        """Time out forming groups (replay too): release them, their members' group_size
        corrected to what arrived, or drop their members."""
        codes, slots = self.sampler.expire(codes, release=action == "release")
        self.timeouts.settle(codes, action)
        if action == "release":
            _, group, arrived = np.unique(self.index["group"][slots], return_inverse=True, return_counts=True)
            self.index["group_size"][slots] = arrived[group]
            self.counters["group_timeouts_released"] += len(codes)
            self.table.remove_slots(self.sampler.rejected(), "zero_variance", log=False)  # drop_zero_variance
        else:
            self.table.remove_slots(slots, "group_timeout", log=False)
            self.counters["group_timeouts_dropped"] += len(codes)

    def settle_named(self, names: list[str], action: str) -> None:
        """Time out the forming groups named (replay of ``GroupsTimedOut``)."""
        self.settle(np.array([self.groups.find(g) for g in names], np.int64), action)

    def retry_after(self) -> float | None:
        """Seconds until the next group timeout, if any (a waiting sample retries then)."""
        if self.timeouts is None:
            return None
        deadline = self.timeouts.next_deadline()
        return None if deadline is None else max(0.0, deadline - self.table.wall_clock()) + 1e-3


def with_released(data: pa.RecordBatch, released: np.ndarray, sizes: np.ndarray) -> pa.RecordBatch:
    """Rows read back from a table with group timeouts: ``group_released_partial`` filled
    in, and ``group_size`` corrected to what arrived for rows of released groups (of
    the columns ``data`` has)."""
    names = data.schema.names
    if COLUMN in names:
        i = names.index(COLUMN)
        data = data.set_column(i, data.schema.field(i), pa.array(released, pa.bool_()))
    if "group_size" in names and released.any():
        i = names.index("group_size")
        stored = data.column(i).to_numpy(zero_copy_only=False)
        values = np.where(released, sizes, np.nan_to_num(stored.astype(np.float64), nan=-1)).astype(np.int64)
        mask = ~released & data.column(i).is_null().to_numpy(zero_copy_only=False)
        data = data.set_column(i, data.schema.field(i), pa.array(values, pa.int32(), mask=mask))
    return data
