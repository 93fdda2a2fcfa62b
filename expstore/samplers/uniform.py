"""Uniform sampling with replacement over the held slots.

Structure: a dense array of the held slots (``_dense[:n]``) and a position map
``_pos[slot]`` (-1: not held). Insert appends; remove swaps the last entries into the holes
(vectorised); sample draws n positions with ``rng.integers``. Every operation is O(1) per
item and a handful of numpy calls per batch.

P(i) = 1 / N for each draw; importance weights are all 1 (uniform needs no correction).
"""

from __future__ import annotations

import numpy as np

from ._util import EMPTY_SLOTS, as_slots, cannot, count, grown
from .base import Items, Selection, Selector


class Uniform(Selector):
    """Uniform with replacement.

    >>> u = Uniform()
    >>> u.insert_slots(np.array([3, 5, 9]))
    >>> u.remove(np.array([5]))
    >>> sorted(set(u.sample(100, np.random.default_rng(0)).slots.tolist()))
    [3, 9]
    """

    with_replacement = True

    def __init__(self) -> None:
        self._dense = np.empty(0, dtype=np.int64)
        self._pos = np.empty(0, dtype=np.int64)
        self._n = 0

    def insert(self, items: Items) -> None:
        """O(k)."""
        self.insert_slots(items.slots)

    def insert_slots(self, slots: np.ndarray) -> None:
        """Add slots (not held already). O(k)."""
        slots = as_slots(slots)
        k = len(slots)
        if k == 0:
            return
        self._dense = grown(self._dense, self._n + k, -1)
        self._pos = grown(self._pos, int(slots.max()) + 1, -1)
        self._dense[self._n:self._n + k] = slots
        self._pos[slots] = np.arange(self._n, self._n + k)
        self._n += k

    def remove(self, slots: np.ndarray) -> None:
        """Swap-remove: the survivors among the last k entries fill the holes the removed
        slots leave in ``[0, n - k)``. O(k), distinct held slots."""
        slots = as_slots(slots)
        k = len(slots)
        if k == 0:
            return
        pos = self._pos[slots]
        keep = self._n - k
        holes = pos[pos < keep]  # removed entries inside the kept prefix
        tail = np.ones(k, dtype=bool)  # which of positions [keep, n) survive
        tail[pos[pos >= keep] - keep] = False
        movers = np.flatnonzero(tail) + keep  # as many as there are holes
        moved = self._dense[movers]
        self._dense[holes] = moved
        self._pos[moved] = holes
        self._pos[slots] = -1
        self._n = keep

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Priorities do not matter here: a no-op."""

    def __len__(self) -> int:
        return self._n

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < len(self._pos) and self._pos[slot] >= 0

    @property
    def slots(self) -> np.ndarray:
        """The held slots (a view, in no particular order)."""
        return self._dense[:self._n]

    def can_sample(self, n: int) -> bool:
        return count(n) == 0 or self._n > 0

    def sample(self, n: int, rng: np.random.Generator) -> Selection:
        """n slots, uniformly with replacement. O(n)."""
        n = count(n)
        if n == 0:
            return Selection(EMPTY_SLOTS.copy(), np.empty(0), np.empty(0))
        if self._n == 0:
            raise cannot("the uniform sampler", n, 0)
        slots = self._dense[rng.integers(0, self._n, size=n)]
        return Selection(slots=slots, probabilities=np.full(n, 1.0 / self._n), weights=np.ones(n))

    def sample_distinct(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n distinct held slots, a uniformly random subset in random order (for the group
        sampler). O(n) expected for n much smaller than len, else O(len)."""
        n = count(n)
        if n > self._n:
            raise cannot("the uniform sampler", n, self._n)
        return self._dense[rng.choice(self._n, size=n, replace=False)]
