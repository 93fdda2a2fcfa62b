"""Fifo (oldest first) and Lifo (newest first) by item id.

``sample(n)`` returns the n oldest (Fifo) or newest (Lifo) held items, n DISTINCT slots,
in that order, with probabilities and weights 1; it does not remove them (the table
does, e.g. a queue removes what it sampled). ``can_sample(n)`` is ``len >= n``. The same
classes serve as the "fifo" and "lifo" removers.

Structure: a log of (slot, id) entries sorted by id, ``[head, tail)`` of three parallel
arrays (slot, id, live), and ``_pos[slot]``, the entry of a held slot (-1: not held).
Slots are reused by the table, so an entry is identified by its position, never by its
slot alone: removing a slot clears the ``live`` flag of its entry and forgets the slot;
a later item in the same slot gets a new entry at the tail.

Lazy compaction: dead entries at the ends are skipped by moving ``head`` / ``tail``
while sampling; the whole log is compacted (live entries moved to the front) when dead
entries outnumber live ones, or when the array is full. Insert and remove are amortised
O(1) per item; sample is O(n + d), d the dead entries interleaved with the n returned
(d <= len by the compaction rule). All numpy, no Python loop per item.

Items arrive in id order (ids are monotonic per table); a batch that is not (a restore,
say) is merged by a sort, O(N log N), once.
"""

from __future__ import annotations

import numpy as np

from ._util import EMPTY_SLOTS, as_slots, cannot, count, deterministic, grown
from .base import Items, Selection, Selector


class _Ordered(Selector):
    newest_first = False
    name = "ordered"

    def __init__(self) -> None:
        self._slot = np.empty(0, dtype=np.int64)
        self._id = np.empty(0, dtype=np.uint64)
        self._live = np.empty(0, dtype=bool)
        self._pos = np.empty(0, dtype=np.int64)
        self._head = self._tail = self._n = 0

    def insert(self, items: Items) -> None:
        self.insert_pairs(items.slots, items.ids)

    def insert_pairs(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Add (slot, id) pairs, slots not held already. Amortised O(k)."""
        slots = as_slots(slots)
        ids = np.asarray(ids, dtype=np.uint64).reshape(-1)
        k = len(slots)
        if k == 0:
            return
        if k > 1 and not np.all(ids[1:] > ids[:-1]):
            order = np.argsort(ids, kind="stable")
            slots, ids = slots[order], ids[order]
        in_order = self._tail == self._head or ids[0] > self._id[self._tail - 1]
        if self._tail + k > len(self._slot):
            self._compact()
            size = self._tail + k
            self._slot = grown(self._slot, size, -1)
            self._id = grown(self._id, size, 0)
            self._live = grown(self._live, size, False)
        end = self._tail + k
        self._slot[self._tail:end] = slots
        self._id[self._tail:end] = ids
        self._live[self._tail:end] = True
        self._pos = grown(self._pos, int(slots.max()) + 1, -1)
        self._pos[slots] = np.arange(self._tail, end)
        self._tail = end
        self._n += k
        if not in_order:
            self._compact(sort=True)

    def remove(self, slots: np.ndarray) -> None:
        """Forget held slots: clear their entries' live flags. Amortised O(k)."""
        slots = as_slots(slots)
        if len(slots) == 0:
            return
        self._live[self._pos[slots]] = False
        self._pos[slots] = -1
        self._n -= len(slots)
        if (self._tail - self._head) - self._n > max(self._n, 64):
            self._compact()

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Order is by id only: a no-op."""

    def __len__(self) -> int:
        return self._n

    def can_sample(self, n: int) -> bool:
        return self._n >= count(n)

    def sample(self, n: int, rng: np.random.Generator | None = None) -> Selection:
        """The n oldest (Fifo) / newest (Lifo) held slots, in that order. ``rng`` is
        unused (accepted for the protocol). O(n + d)."""
        n = count(n)
        if n > self._n:
            raise cannot(self.name, n, self._n)
        if n == 0:
            return deterministic(EMPTY_SLOTS.copy())
        width = n
        while True:  # widen the window until it holds n live entries (at most log steps)
            if self.newest_first:
                lo = max(self._head, self._tail - width)
                live = np.flatnonzero(self._live[lo:self._tail]) + lo
                if len(live) >= n or lo == self._head:
                    self._tail = int(live[-1]) + 1  # drop the dead entries at the end
                    return deterministic(self._slot[live[::-1][:n]])
            else:
                hi = min(self._tail, self._head + width)
                live = np.flatnonzero(self._live[self._head:hi]) + self._head
                if len(live) >= n or hi == self._tail:
                    self._head = int(live[0])  # drop the dead entries at the front
                    return deterministic(self._slot[live[:n]])
            width *= 2

    def _compact(self, sort: bool = False) -> None:
        """Move the live entries to the front (sorted by id if ``sort``). O(tail - head)."""
        live = np.flatnonzero(self._live[self._head:self._tail]) + self._head
        if sort:
            live = live[np.argsort(self._id[live], kind="stable")]
        m = len(live)
        self._slot[:m] = self._slot[live]
        self._id[:m] = self._id[live]
        self._live[:m] = True
        self._live[m:self._tail] = False
        self._pos[self._slot[:m]] = np.arange(m)
        self._head, self._tail = 0, m


class Fifo(_Ordered):
    """Oldest first (smallest id). Sampler "fifo" and remover "fifo".

    >>> f = Fifo()
    >>> f.insert_pairs(np.array([7, 3, 5]), np.array([10, 11, 12]))
    >>> f.remove(np.array([7]))
    >>> f.sample(2).slots.tolist()
    [3, 5]
    """

    newest_first = False
    name = "the fifo selector"


class Lifo(_Ordered):
    """Newest first (largest id). Sampler "lifo" and remover "lifo".

    >>> f = Lifo()
    >>> f.insert_pairs(np.array([7, 3, 5]), np.array([10, 11, 12]))
    >>> f.sample(2).slots.tolist()
    [5, 3]
    """

    newest_first = True
    name = "the lifo selector"
