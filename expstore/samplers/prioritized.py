"""Prioritized sampling with replacement (Schaul et al., 2016), on a sum tree.

Semantics, for N held items with priorities p_i (finite, >= 0):

- ``P(i) = w_i / sum_j w_j`` per draw with ``w_i = p_i ** alpha``, draws independent
  (with replacement); ``alpha = 0`` is uniform over the items of priority > 0.
- A priority of 0 weighs 0 at every ``alpha``, 0 included (where ``0 ** 0`` would be 1):
  it is how a user excludes an item, and Reverb's prioritized selector does the same
  (``reverb/cc/selectors/prioritized.cc``). Such an item is never drawn, unless every held
  priority is 0: then, as in Reverb, the sampler falls back to uniform (``P(i) = 1 / N``),
  so that a table whose priorities were all zeroed still serves instead of failing.
- Importance weights ``w_i = (N * P(i)) ** -beta / max_j (N * P(j)) ** -beta``, the max over
  the returned batch (so the largest weight in a batch is exactly 1; ``beta = 0`` gives
  all ones). ``Selection.probabilities`` holds P(i) of each returned slot.

Complexity: insert, remove, update O(k log C) for k items over a tree of capacity C (the
next power of two above the largest slot); sample O(n log C). All vectorised (see
``sumtree``). The leaf of slot s holds ``w_s``; a removed slot's leaf is 0.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument
from ._util import EMPTY_SLOTS, as_slots, cannot, count
from .base import Items, Selection, Selector
from .sumtree import SumTree
from .uniform import Uniform


class Prioritized(Selector):
    """P(i) ~ priority_i ** alpha, importance weights with exponent beta.

    >>> s = Prioritized(alpha=1.0, beta=0.0)
    >>> s.insert_priorities(np.array([0, 1]), np.array([1.0, 3.0]))
    >>> sel = s.sample(1000, np.random.default_rng(0))
    >>> sorted(set(sel.probabilities.tolist())), float((sel.slots == 1).mean())
    ([0.25, 0.75], 0.769)
    """

    with_replacement = True

    def __init__(self, alpha: float = 1.0, beta: float = 0.0, capacity: int = 1024) -> None:
        if not (math.isfinite(alpha) and alpha >= 0 and math.isfinite(beta) and beta >= 0):
            raise InvalidArgument(f"prioritized needs finite alpha, beta >= 0, got {alpha}, {beta}")
        self.alpha = float(alpha)
        self.beta = float(beta)
        self._tree = SumTree(capacity)
        self._held = Uniform()  # membership, len and the all-zero fallback

    def insert(self, items: Items) -> None:
        self.insert_priorities(items.slots, items.priorities)

    def insert_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Add slots (not held already) with their priorities. O(k log C)."""
        slots = as_slots(slots)
        self._tree.set(slots, self._scaled(priorities, len(slots)))
        self._held.insert_slots(slots)

    def remove(self, slots: np.ndarray) -> None:
        slots = as_slots(slots)
        self._tree.set(slots, 0.0)
        self._held.remove(slots)

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        slots = as_slots(slots)
        self._tree.set(slots, self._scaled(priorities, len(slots)))

    def _scaled(self, priorities: np.ndarray, k: int) -> np.ndarray:
        p = np.asarray(priorities, dtype=np.float64).reshape(-1)
        assert len(p) == k, "one priority per slot"
        assert not np.any(p < 0) and np.all(np.isfinite(p)), "priorities must be finite and >= 0"
        with np.errstate(over="ignore"):
            scaled = np.where(p > 0, np.power(p, self.alpha), 0.0)  # 0 stays 0, even at alpha 0
        if not np.all(np.isfinite(scaled)):
            raise InvalidArgument(f"priority ** alpha overflows float64 (alpha={self.alpha})")
        return scaled

    def stats(self) -> dict[str, float]:
        return {"total_priority": float(self._tree.total)}  # sum of the weights w_i

    def __len__(self) -> int:
        return len(self._held)

    def probabilities(self, slots: np.ndarray) -> np.ndarray:
        """P(i) of held slots, as ``sample`` would report it. O(k)."""
        total = self._tree.total
        if total > 0:
            return self._tree.get(as_slots(slots)) / total
        return np.full(len(as_slots(slots)), 1.0 / max(len(self._held), 1))

    def can_sample(self, n: int) -> bool:
        return count(n) == 0 or len(self._held) > 0

    def sample(self, n: int, rng: np.random.Generator) -> Selection:
        """n slots with replacement by P(i); see the module docstring. O(n log C)."""
        n = count(n)
        if n == 0:
            return Selection(EMPTY_SLOTS.copy(), np.empty(0), np.empty(0))
        size = len(self._held)
        if size == 0:
            raise cannot("the prioritized sampler", n, 0)
        total = self._tree.total
        if total <= 0:  # every priority is 0: uniform
            return self._held.sample(n, rng)
        slots = self._tree.find(rng.random(n) * total)
        probs = self._tree.get(slots) / total
        if self.beta == 0:
            weights = np.ones(n)
        else:  # max over the batch of (N P)^-beta is at the smallest P; ratio keeps it exact
            weights = (probs / probs.min()) ** -self.beta
        return Selection(slots=slots, probabilities=probs, weights=weights)
