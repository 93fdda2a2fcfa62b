"""TaskMixture: split each batch across tasks by mixing weights, one child per task.

Items are routed by ``Items.tasks`` to one child selector per task code (created on the
first item of the task by ``make_child``). The weight of a task is
``weights.get(name, weights.get("*", 0.0))``; an item without a task (code -1) weighs
``weights.get("*", 0.0)``. Items of a zero-weight task are held (counted in ``len``,
routed to their child) but never sampled.

``sample(n)``: n must be a multiple of ``unit`` (the group size for group children, else
1). The ``n / unit`` units are split across the *serving* tasks (weight > 0 and a child
that can serve at least one unit) by one multinomial draw with probabilities
``q_t = w_t / sum_serving w``. Children that sample distinct items (fifo, lifo, heaps,
groups) can serve only so many units; a task drawn more than its child can serve is
capped and the excess redrawn by weight among the tasks that still have room, until
all units are placed. Caps distort the realised ratios toward the tasks that can serve;
with-replacement children (uniform, prioritized) are never capped. When all serving
tasks together cannot serve n, ``sample`` raises FailedPrecondition.

Returned per slot: ``probabilities = q_t * (the child's probability)``; ``weights`` pass
through from the child unchanged (a prioritized child normalises its importance weights
by the max within its own part of the batch, with N its own item count). Slots come
task by task, in task-code order, each task's part in its child's order (whole groups
stay contiguous).

Complexity: insert, remove, update O(k log k) to route by task plus the children's cost
(a loop over the distinct tasks of a batch, not over items); sample O(T log n) child
``can_sample`` calls to find caps, plus the children's sampling.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import FailedPrecondition, InvalidArgument
from ._util import EMPTY_SLOTS, as_slots, count, grown
from .base import Codebook, Items, Selection, Selector


class TaskMixture(Selector):
    """Per-task children mixed by weight; see the module docstring."""

    def __init__(self, weights: dict[str, float], tasks: Codebook,
                 make_child: Callable[[], Selector], unit: int = 1) -> None:
        if int(unit) < 1:
            raise InvalidArgument(f"the mixture unit must be >= 1, got {unit}")
        if not weights or any(not np.isfinite(w) or w < 0 for w in weights.values()):
            raise InvalidArgument(f"task weights must be finite, >= 0 and not empty: {weights}")
        self._weights = dict(weights)
        self._tasks = tasks
        self._make_child = make_child
        self.unit = int(unit)
        self._children: dict[int, Selector] = {}
        self._weight_of: dict[int, float] = {}
        self._task = np.empty(0, dtype=np.int64)  # by slot: task code of the held item
        self._n = 0

    def weight(self, code: int) -> float:
        """Mixing weight of a task code (cached: a code's name never changes)."""
        w = self._weight_of.get(code)
        if w is None:
            default = self._weights.get("*", 0.0)
            w = default if code < 0 else self._weights.get(self._tasks.name(code), default)
            self._weight_of[code] = w = float(w)
        return w

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for code, child in self._children.items():
            name = "*" if code < 0 else self._tasks.name(code)
            out[f"task.{name}.items"] = len(child)
            out.update({f"task.{name}.{k}": v for k, v in child.stats().items()})
        return out

    def children(self) -> dict[int, Selector]:
        """The child selector of each task code seen so far."""
        return dict(self._children)

    def _routes(self, slots: np.ndarray):
        """(code, index array) per distinct task of the held ``slots``."""
        return _split(self._task[slots])

    def insert(self, items: Items) -> None:
        slots = as_slots(items.slots)
        if len(slots) == 0:
            return
        codes = np.asarray(items.tasks, dtype=np.int64)
        self._task = grown(self._task, int(slots.max()) + 1, -1)
        self._task[slots] = codes
        self._n += len(slots)
        for code, idx in _split(codes):
            child = self._children.get(code)
            if child is None:
                child = self._children[code] = self._make_child()
            child.insert(Items(*(np.asarray(getattr(items, f))[idx] for f in _FIELDS)))

    def remove(self, slots: np.ndarray) -> None:
        slots = as_slots(slots)
        self._n -= len(slots)
        for code, idx in self._routes(slots):
            self._children[code].remove(slots[idx])

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        slots = as_slots(slots)
        priorities = np.broadcast_to(np.asarray(priorities, dtype=np.float64), slots.shape)
        for code, idx in self._routes(slots):
            self._children[code].update(slots[idx], priorities[idx])

    def rejected(self) -> np.ndarray:
        parts = [child.rejected() for child in self._children.values()]
        parts = [p for p in parts if len(p)]
        return np.concatenate(parts).astype(np.int64) if parts else EMPTY_SLOTS.copy()

    def __len__(self) -> int:
        return self._n

    def _capacity(self, child: Selector, units: int) -> int:
        """Most units (<= ``units``) the child can serve now: binary search on can_sample."""
        if child.can_sample(units * self.unit):
            return units
        lo, hi = 0, units  # can(lo), not can(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if child.can_sample(mid * self.unit):
                lo = mid
            else:
                hi = mid
        return lo

    def _serving(self, units: int):
        """(codes, weights, caps) of tasks with weight > 0 that can serve >= 1 unit."""
        codes, weights, caps = [], [], []
        for code in sorted(self._children):
            w = self.weight(code)
            if w > 0 and len(self._children[code]) > 0:
                cap = self._capacity(self._children[code], units)
                if cap > 0:
                    codes.append(code)
                    weights.append(w)
                    caps.append(cap)
        return codes, np.array(weights, dtype=np.float64), np.array(caps, dtype=np.int64)

    def can_sample(self, n: int) -> bool:
        n = count(n)
        if n % self.unit:
            return False
        units = n // self.unit
        return units == 0 or int(self._serving(units)[2].sum()) >= units

    def sample(self, n: int, rng: np.random.Generator) -> Selection:
        n = count(n)
        if n % self.unit:
            raise InvalidArgument(f"the task mixture samples whole units: n={n} is not a multiple of {self.unit}")
        units = n // self.unit
        if units == 0:
            return Selection(EMPTY_SLOTS.copy(), np.empty(0), np.empty(0))
        codes, weights, caps = self._serving(units)
        if int(caps.sum()) < units:
            raise FailedPrecondition(f"the task mixture cannot sample {n}: the tasks with weight > 0 "
                                     f"can serve {int(caps.sum()) * self.unit} together")
        q = weights / weights.sum()
        take = rng.multinomial(units, q)
        while True:  # cap and redraw the excess among the tasks with room (<= T rounds)
            excess = int(np.maximum(take - caps, 0).sum())
            if excess == 0:
                break
            take = np.minimum(take, caps)
            room = take < caps
            w = np.where(room, weights, 0.0)
            take = take + rng.multinomial(excess, w / w.sum())
        parts = []
        for code, k, qt in zip(codes, take.tolist(), q.tolist()):
            if k:
                sel = self._children[code].sample(k * self.unit, rng)
                parts.append((sel.slots, qt * sel.probabilities, sel.weights))
        return Selection(slots=np.concatenate([p[0] for p in parts]).astype(np.int64),
                         probabilities=np.concatenate([p[1] for p in parts]),
                         weights=np.concatenate([p[2] for p in parts]))


_FIELDS = ("slots", "ids", "priorities", "groups", "group_sizes", "tasks", "rewards")


def _split(codes: np.ndarray):
    """Yield (code, indices) for each distinct value of ``codes``; O(k log k)."""
    if len(codes) == 0:
        return
    order = np.argsort(codes, kind="stable")
    sorted_codes = codes[order]
    cuts = np.flatnonzero(sorted_codes[1:] != sorted_codes[:-1]) + 1
    for idx in np.split(order, cuts):
        yield int(codes[idx[0]]), idx
