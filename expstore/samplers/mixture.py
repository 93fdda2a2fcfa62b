"""TaskMixture: split each batch across tasks by weights and quotas, per data version.

Items are routed by (``Items.tasks``, ``Items.data_versions``) to one child selector per
task and data version (created on the item that first needs it by ``make_child``). The
weight of a task is ``weights.get(name, weights.get("*", 0.0))``; an item without a task
(code -1) weighs ``weights.get("*", 0.0)``. Items of a zero-weight task without a
quota are held (counted in ``len``, routed to their child) but never sampled.

``sample(n, rng, versions)``: n must be a multiple of ``unit`` (the group size for group
children, else 1); the batch is ``n / unit`` units. ``versions`` (``{task: (lo, hi)}``,
``"*"`` for unlisted tasks, either bound None for open) restricts each task to its
children whose data version is in [lo, hi]; the rest of the task is held for this call.

1. Quotas (``{task: {"min": a, "max": b}}``): the task gets at least ``ceil(a * units)``
   and at most ``floor(b * units)`` units, exactly, in every batch. Unlisted tasks: 0 and
   ``units``. A batch size whose minimums add up to more than its units is refused
   (InvalidArgument: it can never be served).
2. The units left after the minimums are split across the *serving* tasks (weight > 0
   and in-range children that can serve at least one unit) by one multinomial draw with
   probabilities ``q_t = w_t / sum_serving w``. A task drawn beyond its room (its max,
   or what its children can serve: distinct-item children such as fifo, heaps and groups
   serve only so many) is capped and the excess redrawn by weight among the tasks that
   still have room, until all units are placed. Caps distort the realised ratios toward
   the tasks that can serve; with-replacement children (uniform, prioritized) are only
   capped by the quotas.
3. Within a task, its units are split across its in-range version children the same
   way, with weights proportional to the children's sizes (items held; for group
   children, as held items too), so that a uniform task samples uniformly over the
   union of its versions.

When the tasks cannot serve n under these rules (a minimum the task's in-range children
cannot serve, or too little room for the rest), ``can_sample`` is False and ``sample``
raises FailedPrecondition; ``explain(n)`` says which task holds the batch back (the
table waits for inserts, as for any sampler that cannot serve yet).

Returned per slot: ``probabilities = q_t * (the version child's share of the task's
size) * (the child's probability)`` (q_t is 0 for a zero-weight task sampled only for
its minimum); ``weights`` pass through from the child unchanged (a prioritized child
normalises its importance weights by the max within its own part of the batch, with N
its own item count). Slots come task by task in task-code order, each task's versions
in ascending order, each part in its child's order (whole groups stay contiguous).

Complexity: insert, remove, update O(k log k) to route plus the children's cost (a loop
over the distinct (task, version) pairs of a batch, not over items); sample O(C log n)
child ``can_sample`` calls (C children in range) to find caps, plus the children's
sampling.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

from ..errors import FailedPrecondition, InvalidArgument
from ._util import EMPTY_SLOTS, as_slots, count, grown
from .base import Codebook, Items, Selection, Selector

Versions = Mapping[str, tuple[int | None, int | None]]
_EPS = 1e-9


class TaskMixture(Selector):
    """Per-task, per-version children mixed by weight and quota; see the module docstring."""

    def __init__(self, weights: dict[str, float], tasks: Codebook,
                 make_child: Callable[[], Selector], unit: int = 1,
                 quotas: dict[str, dict[str, float]] | None = None) -> None:
        if int(unit) < 1:
            raise InvalidArgument(f"the mixture unit must be >= 1, got {unit}")
        if not weights or any(not np.isfinite(w) or w < 0 for w in weights.values()):
            raise InvalidArgument(f"task weights must be finite, >= 0 and not empty: {weights}")
        self._weights = dict(weights)
        self._quotas = dict(quotas or {})
        self._tasks = tasks
        self._make_child = make_child
        self.unit = int(unit)
        child = make_child()  # each child samples the same way
        self.with_replacement, self.group_size = child.with_replacement, child.group_size
        self._children: dict[tuple[int, int], Selector] = {}
        self._weight_of: dict[int, float] = {}
        self._task = np.empty(0, dtype=np.int64)  # by slot: task code of the held item
        self._version = np.empty(0, dtype=np.int64)  # by slot: its data version
        self._n = 0

    def weight(self, code: int) -> float:
        """Mixing weight of a task code (cached: a code's name never changes)."""
        w = self._weight_of.get(code)
        if w is None:
            default = self._weights.get("*", 0.0)
            w = default if code < 0 else self._weights.get(self._tasks.name(code), default)
            self._weight_of[code] = w = float(w)
        return w

    def _name(self, code: int) -> str:
        return "*" if code < 0 else self._tasks.name(code)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for code, children in self._by_task().items():
            name = self._name(code)
            out[f"task.{name}.items"] = sum(len(c) for c in children.values())
            for child in children.values():
                for k, v in child.stats().items():
                    out[f"task.{name}.{k}"] = out.get(f"task.{name}.{k}", 0) + v
        return out

    def _by_task(self) -> dict[int, dict[int, Selector]]:
        out: dict[int, dict[int, Selector]] = {}
        for (code, version), child in sorted(self._children.items()):
            out.setdefault(code, {})[version] = child
        return out

    def _routes(self, slots: np.ndarray):
        """((task code, version), index array) per distinct pair of the held ``slots``."""
        return _split(self._task[slots], self._version[slots])

    def insert(self, items: Items) -> None:
        slots = as_slots(items.slots)
        if len(slots) == 0:
            return
        codes = np.asarray(items.tasks, dtype=np.int64)
        versions = np.zeros(len(slots), np.int64) if items.data_versions is None \
            else np.asarray(items.data_versions, dtype=np.int64)
        top = int(slots.max()) + 1
        self._task = grown(self._task, top, -1)
        self._version = grown(self._version, top, 0)
        self._task[slots] = codes
        self._version[slots] = versions
        self._n += len(slots)
        for key, idx in _split(codes, versions):
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._make_child()
            child.insert(items.take(idx))

    def remove(self, slots: np.ndarray) -> None:
        slots = as_slots(slots)
        self._n -= len(slots)
        for key, idx in self._routes(slots):
            self._children[key].remove(slots[idx])

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        slots = as_slots(slots)
        priorities = np.broadcast_to(np.asarray(priorities, dtype=np.float64), slots.shape)
        for key, idx in self._routes(slots):
            self._children[key].update(slots[idx], priorities[idx])

    def rejected(self) -> np.ndarray:
        parts = [child.rejected() for child in self._children.values()]
        parts = [p for p in parts if len(p)]
        return np.concatenate(parts).astype(np.int64) if parts else EMPTY_SLOTS.copy()

    def forming(self, codes: np.ndarray) -> np.ndarray:
        """Group timeouts: the codes among ``codes`` some child's group is forming under."""
        parts = [child.forming(codes) for child in self._children.values()]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def expire(self, codes: np.ndarray, release: bool) -> tuple[np.ndarray, np.ndarray]:
        """Group timeouts, forwarded to every child (each ignores the groups it does not hold)."""
        parts = [child.expire(codes, release) for child in self._children.values()]
        parts = [p for p in parts if len(p[0])]
        if not parts:
            return np.zeros(0, np.int64), EMPTY_SLOTS.copy()
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def __len__(self) -> int:
        return self._n

    # -- sampling ----------------------------------------------------------------------

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

    def _bounds(self, code: int, units: int) -> tuple[int, int]:
        """A task's quota as unit counts for a batch of ``units``: (min, max)."""
        q = self._quotas.get(self._name(code)) if code >= 0 else None
        if q is None:
            return 0, units
        return math.ceil(q.get("min", 0.0) * units - _EPS), math.floor(q.get("max", 1.0) * units + _EPS)

    def _in_range(self, code: int, versions: Versions | None) -> dict[int, Selector]:
        children = {v: c for (t, v), c in self._children.items() if t == code}
        if not versions:
            return children
        lo, hi = versions.get(self._name(code), versions.get("*", (None, None)))
        return {v: c for v, c in children.items() if (lo is None or v >= lo) and (hi is None or v <= hi)}

    def _plan(self, units: int, versions: Versions | None):
        """Per task: (code, weight, min, room, in-range children, their caps), and why
        the batch cannot be served (None if it can)."""
        quota_codes = [self._tasks.find(name) for name in self._quotas]
        codes = sorted({t for t, _ in self._children} | {c for c in quota_codes if c >= 0})
        plan, why = [], None
        need = sum(self._bounds(c, units)[0] for c in codes)
        missing = [name for name, c in zip(self._quotas, quota_codes)
                   if c < 0 and self._bounds_of(name, units)[0] > 0]
        if missing:
            why = f"task {missing[0]!r} has no items for its min quota"
        for code in codes:
            lo, hi = self._bounds(code, units)
            w = self.weight(code)
            children = self._in_range(code, versions) if (w > 0 or lo > 0) else {}
            caps = {v: self._capacity(c, units) for v, c in children.items() if len(c)}
            cap = min(units, sum(caps.values()))
            if lo > cap and why is None:
                why = f"task {self._name(code)!r} can serve {cap} of the {lo} units its min quota needs"
            room = max(0, min(hi, cap) - lo) if w > 0 else 0
            plan.append((code, w, min(lo, cap), room, children, caps))
        if why is None and units - need > sum(p[3] for p in plan):
            why = (f"the tasks with weight > 0 can serve {sum(p[3] for p in plan)} units beyond the min quotas, "
                   f"{units - need} needed")
        return plan, why

    def _bounds_of(self, name: str, units: int) -> tuple[int, int]:
        q = self._quotas[name]
        return math.ceil(q.get("min", 0.0) * units - _EPS), math.floor(q.get("max", 1.0) * units + _EPS)

    def _units(self, n: int) -> int:
        n = count(n)
        if n % self.unit:
            raise InvalidArgument(f"the task mixture samples whole units: n={n} is not a multiple of {self.unit}")
        units = n // self.unit
        mins = sum(self._bounds_of(name, units)[0] for name in self._quotas)
        if mins > units:
            raise InvalidArgument(f"a batch of {n} cannot meet the min quotas of {sorted(self._quotas)}: they "
                                  f"need {mins * self.unit} together (each rounds up)")
        return units

    def can_sample(self, n: int, versions: Versions | None = None) -> bool:
        try:
            units = self._units(n)
        except InvalidArgument:
            return False
        return units == 0 or self._plan(units, versions)[1] is None

    def explain(self, n: int, versions: Versions | None = None) -> str:
        """Why ``sample(n)`` cannot be served now ("" if it can)."""
        units = self._units(n)
        return (units and self._plan(units, versions)[1]) or ""

    def sample(self, n: int, rng: np.random.Generator, versions: Versions | None = None) -> Selection:
        units = self._units(n)
        if units == 0:
            return Selection(EMPTY_SLOTS.copy(), np.empty(0), np.empty(0))
        plan, why = self._plan(units, versions)
        if why is not None:
            raise FailedPrecondition(f"the task mixture cannot sample {n}: {why}")
        take = np.array([p[2] for p in plan], np.int64)
        weights = np.array([p[1] for p in plan], np.float64)
        room = np.array([p[3] for p in plan], np.int64)
        serving = room > 0
        q = np.where(serving, weights, 0.0)
        q = q / q.sum() if q.sum() > 0 else q
        take += allocate(units - int(take.sum()), weights, room, rng)
        parts = []
        for (code, _, _, _, children, caps), k, qt in zip(plan, take.tolist(), q.tolist()):
            if not k:
                continue
            versions_ = sorted(caps)
            sizes = np.array([len(children[v]) for v in versions_], np.float64)
            share = sizes / sizes.sum()
            split = allocate(k, sizes, np.array([caps[v] for v in versions_], np.int64), rng)
            for v, kv, sv in zip(versions_, split.tolist(), share.tolist()):
                if kv:
                    sel = children[v].sample(kv * self.unit, rng)
                    parts.append((sel.slots, qt * sv * sel.probabilities, sel.weights))
        return Selection(slots=np.concatenate([p[0] for p in parts]).astype(np.int64),
                         probabilities=np.concatenate([p[1] for p in parts]),
                         weights=np.concatenate([p[2] for p in parts]))


def allocate(total: int, weights: np.ndarray, caps: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``total`` units over slots by one multinomial draw ~ weights (among caps > 0),
    capping at ``caps`` and redrawing the excess among those with room; at most one
    round per slot. The caller guarantees sum(caps where weight > 0) >= total."""
    take = np.zeros(len(weights), np.int64)
    if total == 0:
        return take
    w = np.where(caps > 0, weights, 0.0)
    take = rng.multinomial(total, w / w.sum())
    while True:
        excess = int(np.maximum(take - caps, 0).sum())
        if excess == 0:
            return take
        take = np.minimum(take, caps)
        w = np.where(take < caps, weights, 0.0)
        take = take + rng.multinomial(excess, w / w.sum())


def _split(codes: np.ndarray, versions: np.ndarray):
    """Yield ((code, version), indices) for each distinct pair; O(k log k)."""
    if len(codes) == 0:
        return
    order = np.lexsort((versions, codes))
    c, v = codes[order], versions[order]
    cuts = np.flatnonzero((c[1:] != c[:-1]) | (v[1:] != v[:-1])) + 1
    for idx in np.split(order, cuts):
        yield (int(codes[idx[0]]), int(versions[idx[0]])), idx
