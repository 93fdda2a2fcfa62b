"""MaxHeap / MinHeap: the n highest (lowest) priority items, ties to the least recently
inserted or updated.

``sample(n)`` returns n DISTINCT held slots ordered by priority, highest (MaxHeap) or
lowest (MinHeap) first; among equal priorities the item least recently inserted or
updated comes first, as in Reverb (``reverb/cc/selectors/heap.cc``: an update, even to
the same priority, sends the item behind its equals, so equal items rotate). Items of
one ``insert`` or ``update`` call count as touched in the order given. Probabilities and
weights are 1. MinHeap is also the "min_priority" remover. Sampling does not consume:
asking twice without a change returns the same slots.

Structure: a binary heap (``heapq``, a Python list) of entries ``(key, seq, slot)`` with
``key = -priority`` (max) or ``priority`` (min) and ``seq`` a counter of inserts and
updates, plus per-slot arrays ``_seq`` (the sequence number of the slot's current entry,
-1: not held) and priorities. An entry is live iff ``_seq[slot] == seq``: remove and
update never search the heap, they just invalidate the slot's old entry (update pushes a
fresh one). Stale entries are dropped when popped, and the heap is rebuilt from the
per-slot arrays once stale entries outnumber live ones (O(N), amortised O(1) per
remove/update).

Complexity: insert and update O(k log H) (or O(H + k) by ``heapify`` for a large batch);
remove O(k) amortised; sample O((n + s) log H), s the stale entries met. The heap forces
a Python loop over the n sampled and k inserted entries (``heapq`` calls, in C); nothing
else loops per item. sortedcontainers is not a declared dependency, so it is not used.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from ._util import EMPTY_SLOTS, as_slots, cannot, count, deterministic, grown
from .base import Items, Selection, Selector


class _Heap(Selector):
    sign = 1.0  # key = sign * priority; the heap pops the smallest key first
    name = "heap"

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._seq = np.empty(0, dtype=np.int64)
        self._prio = np.empty(0, dtype=np.float64)
        self._next_seq = 0
        self._n = 0
        self._stale = 0

    def insert(self, items: Items) -> None:
        slots = as_slots(items.slots)
        if len(slots) == 0:
            return
        size = int(slots.max()) + 1
        self._seq = grown(self._seq, size, -1)
        self._prio = grown(self._prio, size, 0.0)
        self._n += len(slots)
        self._push(slots, items.priorities)

    def remove(self, slots: np.ndarray) -> None:
        slots = as_slots(slots)
        self._seq[slots] = -1
        self._n -= len(slots)
        self._stale += len(slots)
        self._maybe_rebuild()

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        slots = as_slots(slots)
        held = self._seq[slots] >= 0  # an update never resurrects a removed slot
        if not held.all():
            slots = slots[held]
            priorities = np.broadcast_to(np.asarray(priorities, dtype=np.float64), held.shape)[held]
        if len(slots) == 0:
            return
        self._stale += len(slots)
        self._push(slots, priorities)
        self._maybe_rebuild()

    def _push(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        prio = np.broadcast_to(np.asarray(priorities, dtype=np.float64), slots.shape)
        assert not np.any(np.isnan(prio)), "priorities must not be NaN"
        seq = np.arange(self._next_seq, self._next_seq + len(slots))
        self._next_seq += len(slots)
        self._seq[slots] = seq
        self._prio[slots] = prio
        # A repeated slot in one batch: only its last entry is live (``_seq`` kept the last).
        entries = zip((self.sign * prio).tolist(), seq.tolist(), slots.tolist())
        heap = self._heap
        if len(slots) * math.log2(len(heap) + 2) > len(heap):
            heap.extend(entries)
            heapq.heapify(heap)
        else:
            for entry in entries:
                heapq.heappush(heap, entry)

    def _maybe_rebuild(self) -> None:
        if self._stale > max(self._n, 64):
            slots = np.flatnonzero(self._seq >= 0)
            self._heap = list(zip((self.sign * self._prio[slots]).tolist(), self._seq[slots].tolist(),
                                  slots.tolist()))
            heapq.heapify(self._heap)
            self._stale = 0

    def __len__(self) -> int:
        return self._n

    def can_sample(self, n: int) -> bool:
        return self._n >= count(n)

    def sample(self, n: int, rng: np.random.Generator | None = None) -> Selection:
        """The n first held slots in heap order (see the module docstring); ``rng`` is
        unused. O((n + s) log H)."""
        n = count(n)
        if n > self._n:
            raise cannot(self.name, n, self._n)
        heap, seq = self._heap, self._seq
        taken = []
        while len(taken) < n:
            entry = heapq.heappop(heap)
            if seq[entry[2]] == entry[1]:
                taken.append(entry)
            else:
                self._stale -= 1
        for entry in taken:
            heapq.heappush(heap, entry)
        return deterministic(np.array([e[2] for e in taken], dtype=np.int64) if taken else EMPTY_SLOTS.copy())

    def priorities(self, slots: np.ndarray) -> np.ndarray:
        """Current priorities of held slots. O(k)."""
        return self._prio[as_slots(slots)]


class MaxHeap(_Heap):
    """Highest priority first, ties: least recently inserted or updated first. Sampler
    "max_heap".

    >>> h = MaxHeap()
    >>> from expstore.samplers.base import Items
    >>> z = np.zeros(3)
    >>> h.insert(Items(np.array([0, 1, 2]), np.array([1, 2, 3], dtype=np.uint64),
    ...                np.array([5.0, 9.0, 5.0]), z, z, z, z))
    >>> h.sample(3).slots.tolist()
    [1, 0, 2]
    >>> h.update(np.array([0]), np.array([5.0]))  # the same priority: behind its equal now
    >>> h.sample(3).slots.tolist()
    [1, 2, 0]
    """

    sign = -1.0
    name = "the max_heap selector"


class MinHeap(_Heap):
    """Lowest priority first, ties: least recently inserted or updated first. Sampler
    "min_heap" and remover "min_priority"."""

    sign = 1.0
    name = "the min_heap selector"
