"""GroupSampler: whole GRPO groups only, once complete.

Semantics (a group is the set of items sharing an ``Items.groups`` code):

- A group is *complete* when ``group_size`` members have arrived and none has left. Only
  complete groups are ever returned, never a partial one. ``sample(n)`` needs n to be a
  multiple of ``group_size`` (else InvalidArgument) and returns ``n / group_size``
  DISTINCT groups, each group's members contiguous (in arrival order), chosen uniformly
  among the complete groups (``order="uniform"``, a random subset in random order),
  oldest-completed first (``order="fifo"``) or newest-completed first (``order="lifo"``:
  on-policy training takes the freshest groups and lets the others age out through
  ``max_staleness``); completion time is the id of the member that completed the group.
  Sampling does not consume: the table removes what it must.
- Items with ``groups == -1`` are held (counted in ``len``) but never eligible.
- A group that loses a member (``remove``) is *broken*, for good: it is never eligible
  again and its remaining members are held until the table removes them. Later arrivals
  with the same code (the table never reuses codes; a restore or a bug could) stay
  attached to the broken group: held, never eligible.
- Arrivals beyond ``group_size`` for one code (the ``group_size + 1``-th and later, counting
  every arrival even if earlier members left) are *rejected*: held, never eligible, and
  reported by ``rejected()`` so that the table removes them. Removing a rejected item
  does not affect its group.
- ``drop_zero_variance``: when a group completes with all rewards equal and none NaN, it
  carries no GRPO signal: it is never eligible and all its members are reported by
  ``rejected()``. A group with any NaN reward (reward not set) is kept. A group of size 1
  always has zero variance. Rewards are taken as they were at insert.
- ``expire(codes, release)`` (group timeouts, expstore/group_timeouts.py): of the given
  groups, those still forming (members arrived but fewer than ``group_size``, none
  lost) are released, eligible from now on with the members they have (``drop_zero_
  variance`` applies to them), or dropped (their members are returned for the table
  to remove; later arrivals are held). A batch then holds fewer rows than n: a
  released group counts as one of the ``n / group_size`` groups.
- Probabilities: ``1 / M`` per returned slot for uniform (the chance that one draw picks
  the group among M complete groups), 1 for fifo and lifo; weights are 1.

Structure: per group code (codes are dense) a state byte, an arrival count and a row; a
row of the ``(rows, group_size)`` member matrix per forming or complete group (rows are
recycled, so memory is ``O(codes ever seen)`` bytes plus ``O(live groups * group_size)``);
the complete groups' rows in a ``Uniform``, ``Fifo`` or ``Lifo`` selector. Insert and
remove are O(k log k) (a sort of the batch by group), sample O(n); all vectorised.
"""

from __future__ import annotations

import numpy as np

from ..errors import FailedPrecondition, InvalidArgument
from ._util import EMPTY_SLOTS, as_slots, count, grown, unique
from .base import Items, Selection, Selector
from .ordered import Fifo, Lifo
from .uniform import Uniform

FORMING, COMPLETE, BROKEN, DROPPED = 0, 1, 2, 3
ORDERS = {"uniform": Uniform, "fifo": Fifo, "lifo": Lifo}  # selectors of complete groups' rows


class GroupSampler(Selector):
    """Complete GRPO groups of ``group_size`` members; see the module docstring."""

    def __init__(self, group_size: int, drop_zero_variance: bool = False, order: str = "uniform") -> None:
        if int(group_size) < 1:
            raise InvalidArgument(f"the group sampler needs group_size >= 1, got {group_size}")
        if order not in ORDERS:
            raise InvalidArgument(f"group order must be one of {', '.join(map(repr, ORDERS))}, got {order!r}")
        self.group_size = self.unit = int(group_size)
        self.drop_zero_variance = bool(drop_zero_variance)
        self.order = order
        self._eligible = ORDERS[order]()  # rows of complete groups
        self._state = np.empty(0, dtype=np.int8)     # by group code
        self._arrived = np.empty(0, dtype=np.int64)  # by group code
        self._row = np.empty(0, dtype=np.int64)      # by group code, -1: none
        self._members = np.empty((0, self.group_size), dtype=np.int64)  # by row
        self._rows_used = 0
        self._free = np.empty(0, dtype=np.int64)     # recycled rows (a stack)
        self._nfree = 0
        self._code = np.empty(0, dtype=np.int64)     # by slot: group code, -1 none/rejected
        self._reward = np.empty(0, dtype=np.float64)  # by slot
        self._ids = np.empty(0, dtype=np.uint64)     # by slot
        self._n = 0
        self._rejected: list[np.ndarray] = []

    def insert(self, items: Items) -> None:
        slots = as_slots(items.slots)
        if len(slots) == 0:
            return
        top = int(slots.max()) + 1
        self._code = grown(self._code, top, -1)
        self._reward = grown(self._reward, top, np.nan)
        self._ids = grown(self._ids, top, 0)
        self._code[slots] = -1
        self._reward[slots] = items.rewards
        self._ids[slots] = items.ids
        self._n += len(slots)
        grouped = np.asarray(items.groups, dtype=np.int64) >= 0
        if not grouped.any():
            return
        codes = np.asarray(items.groups, dtype=np.int64)[grouped]
        slots, ids = slots[grouped], np.asarray(items.ids)[grouped]
        order = np.lexsort((ids, codes))  # by group, then age
        slots, codes = slots[order], codes[order]
        ncodes = int(codes.max()) + 1
        self._state = grown(self._state, ncodes, FORMING)
        self._arrived = grown(self._arrived, ncodes, 0)
        self._row = grown(self._row, ncodes, -1)
        # 0-based arrival number of each item within its group, across batches
        first = np.r_[True, codes[1:] != codes[:-1]]
        starts = np.flatnonzero(first)
        rank = np.arange(len(codes)) - starts[np.cumsum(first) - 1]
        arrival = self._arrived[codes] + rank
        uniq = codes[starts]
        self._arrived[uniq] += np.diff(np.r_[starts, len(codes)])
        extra = arrival >= self.group_size
        if extra.any():
            self._rejected.append(slots[extra])
            keep = ~extra
            slots, codes, arrival = slots[keep], codes[keep], arrival[keep]
        self._code[slots] = codes
        forming = self._state[codes] == FORMING  # the others are broken: held, ineligible
        slots, codes, arrival = slots[forming], codes[forming], arrival[forming]
        if len(codes) == 0:
            return
        uniq = unique(codes)
        new = uniq[self._row[uniq] < 0]
        self._row[new] = self._alloc(len(new))
        self._members[self._row[codes], arrival] = slots
        done = uniq[self._arrived[uniq] >= self.group_size]  # extras were cut above
        if len(done):
            self._complete(done)

    def _complete(self, codes: np.ndarray) -> None:
        """Make groups eligible (complete, or released with holes: member -1)."""
        rows = self._row[codes]
        members = self._members[rows]  # (groups, group_size)
        present = members >= 0
        if self.drop_zero_variance:
            rewards = np.where(present, self._reward[members], self._reward[members[:, :1]])
            flat = np.all(rewards == rewards[:, :1], axis=1)  # NaN never equals: kept
            if flat.any():
                self._state[codes[flat]] = DROPPED
                self._rejected.append(members[flat][present[flat]])
                self._release(rows[flat])
                self._row[codes[flat]] = -1
                codes, rows, members, present = codes[~flat], rows[~flat], members[~flat], present[~flat]
        self._state[codes] = COMPLETE
        if self.order != "uniform":
            self._eligible.insert_pairs(rows, np.where(present, self._ids[members], 0).max(axis=1))
        else:
            self._eligible.insert_slots(rows)

    def forming(self, codes: np.ndarray) -> np.ndarray:
        """The codes among ``codes`` whose group is still forming (members arrived, fewer
        than group_size, none lost), sorted."""
        codes = unique(np.asarray(codes, dtype=np.int64))
        codes = codes[(codes >= 0) & (codes < len(self._state))]
        return codes[(self._state[codes] == FORMING) & (self._row[codes] >= 0)]

    def expire(self, codes: np.ndarray, release: bool) -> tuple[np.ndarray, np.ndarray]:
        """Time out the groups among ``codes`` that are still forming: release them (see
        the module docstring) or drop them. Returns (the codes acted on, their members'
        slots, the members of each group contiguous). Other codes are ignored."""
        codes = self.forming(codes)
        if len(codes) == 0:
            return codes, EMPTY_SLOTS.copy()
        members = self._members[self._row[codes]]
        slots = members[members >= 0]
        if release:
            self._complete(codes)
        else:
            self._state[codes] = DROPPED
            self._release(self._row[codes])
            self._row[codes] = -1
        return codes, slots

    def remove(self, slots: np.ndarray) -> None:
        """Forget items; the groups they belonged to (forming or complete) break."""
        slots = as_slots(slots)
        self._n -= len(slots)
        codes = self._code[slots]
        self._code[slots] = -1
        codes = unique(codes[codes >= 0])
        state = self._state[codes]
        codes = codes[(state == FORMING) | (state == COMPLETE)]
        if len(codes) == 0:
            return
        rows = self._row[codes]
        complete = self._state[codes] == COMPLETE
        self._eligible.remove(rows[complete])
        self._release(rows)
        self._state[codes] = BROKEN
        self._row[codes] = -1

    def _alloc(self, m: int) -> np.ndarray:
        take = min(m, self._nfree)
        rows = self._free[self._nfree - take:self._nfree].copy()
        self._nfree -= take
        fresh = np.arange(self._rows_used, self._rows_used + m - take)
        self._rows_used += m - take
        if self._rows_used > len(self._members):
            bigger = np.full((max(self._rows_used, 2 * len(self._members), 16), self.group_size), -1, dtype=np.int64)
            bigger[:len(self._members)] = self._members
            self._members = bigger
        return np.concatenate([rows, fresh])

    def _release(self, rows: np.ndarray) -> None:
        self._members[rows] = -1  # a recycled row may be released with holes
        self._free = grown(self._free, self._nfree + len(rows), -1)
        self._free[self._nfree:self._nfree + len(rows)] = rows
        self._nfree += len(rows)

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Priorities do not matter here: a no-op."""

    def __len__(self) -> int:
        return self._n

    @property
    def complete_groups(self) -> int:
        """Complete groups that can be sampled now."""
        return len(self._eligible)

    def stats(self) -> dict[str, float]:
        return {"complete_groups": self.complete_groups}

    def rejected(self) -> np.ndarray:
        out = np.concatenate(self._rejected) if self._rejected else EMPTY_SLOTS.copy()
        self._rejected = []
        return out

    def can_sample(self, n: int) -> bool:
        n = count(n)
        return n % self.group_size == 0 and n // self.group_size <= len(self._eligible)

    def sample(self, n: int, rng: np.random.Generator) -> Selection:
        """n / group_size distinct complete groups, members contiguous. O(n)."""
        n = count(n)
        if n % self.group_size:
            raise InvalidArgument(f"the group sampler returns whole groups: n={n} is not a "
                                  f"multiple of group_size={self.group_size}")
        k, m = n // self.group_size, len(self._eligible)
        if k > m:
            raise FailedPrecondition(f"the group sampler cannot sample {k} groups ({n} items): "
                                     f"{m} complete group(s)")
        if self.order != "uniform":
            rows, p = self._eligible.sample(k).slots, 1.0
        else:
            rows, p = self._eligible.sample_distinct(k, rng), 1.0 / max(m, 1)
        slots = self._members[rows].reshape(-1)
        slots = slots[slots >= 0]  # released groups have fewer members
        return Selection(slots=slots, probabilities=np.full(len(slots), p), weights=np.ones(len(slots)))
