"""Consumer groups: each group reads a table's items in insertion (id) order, each item
once, with at-least-once delivery.

A delivered item is *in flight* until acked; one not acked within its visibility timeout
is delivered again (SQS semantics, on Kafka-style ordered reads). ``position`` is the next
id the group has not read; ``committed`` is the low watermark below which every item was
acked or skipped, the offset a restart resumes from. State is numpy arrays, so a batch of
acks or deliveries is a few vectorised calls. Not thread-safe: the table holds its lock.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .errors import NotFound


class ConsumerGroup:
    def __init__(self, name: str, position: int) -> None:
        self.name = name
        self.start = position  # ids below it were never offered to the group
        self.position = position
        self.inflight_ids = np.zeros(0, dtype=np.uint64)
        self.deadlines = np.zeros(0, dtype=np.float64)
        self.delivered = 0
        self.redelivered = 0
        self.acked = 0
        self.cuts: dict[int, dict[str, Any]] = {}  # step -> position, in-flight ids, tag

    @property
    def committed(self) -> int:
        """Every id below this was acked (or skipped because its item left the table)."""
        return int(self.inflight_ids.min()) if len(self.inflight_ids) else self.position

    def expired(self, now: float, limit: int) -> np.ndarray:
        """Up to ``limit`` in-flight ids whose visibility timeout passed, oldest first."""
        due = self.deadlines <= now
        if not due.any():
            return np.zeros(0, dtype=np.uint64)
        ids = np.sort(self.inflight_ids[due])
        return ids[:limit]

    def next_deadline(self) -> float | None:
        return float(self.deadlines.min()) if len(self.deadlines) else None

    def deliver(self, new_ids: np.ndarray, again_ids: np.ndarray, deadline: float) -> None:
        """Record a delivery: ``new_ids`` read for the first time (ascending, all >= position),
        ``again_ids`` redelivered from in flight."""
        if len(again_ids):
            self.deadlines[np.isin(self.inflight_ids, again_ids)] = deadline
            self.redelivered += len(again_ids)
        if len(new_ids):
            self.inflight_ids = np.concatenate([self.inflight_ids, new_ids])
            self.deadlines = np.concatenate([self.deadlines, np.full(len(new_ids), deadline)])
            self.position = int(new_ids[-1]) + 1
        self.delivered += len(new_ids) + len(again_ids)

    def forget(self, ids: np.ndarray) -> None:
        """Drop in-flight ids whose items left the table: nothing is left to redeliver."""
        keep = ~np.isin(self.inflight_ids, ids)
        self.inflight_ids, self.deadlines = self.inflight_ids[keep], self.deadlines[keep]

    def check_ack(self, ids: np.ndarray, table: str) -> None:
        """Raise NotFound (and change nothing) if any id was never delivered to the group."""
        never = ((ids < self.start) | (ids >= self.position)) & ~np.isin(ids, self.inflight_ids)
        if never.any():
            raise NotFound(f"table {table!r}: consumer group {self.name!r} was never delivered "
                           f"item {int(ids[never][0])}; ack only ids returned by Stream")

    def ack(self, ids: np.ndarray) -> tuple[int, int]:
        """Ack delivered ids; returns (newly acked, already acked). Call check_ack first."""
        ids = np.unique(ids)
        hit = np.isin(self.inflight_ids, ids)
        n = int(hit.sum())
        self.inflight_ids, self.deadlines = self.inflight_ids[~hit], self.deadlines[~hit]
        self.acked += n
        return n, len(ids) - n

    def stats(self) -> dict[str, float]:
        return {"position": self.position, "committed": self.committed,
                "inflight": len(self.inflight_ids), "delivered": self.delivered,
                "redelivered": self.redelivered, "acked": self.acked}

    # -- training cuts ----------------------------------------------------------------

    def cut(self, step: int, tag: str) -> None:
        """Remember where the group stands: resuming at ``step`` redelivers everything
        delivered after this point (acked or not) and everything in flight now."""
        self.cuts[step] = {"position": self.position, "inflight": self.inflight_ids.tolist(), "tag": tag}

    def check_cut(self, step: int, table: str) -> None:
        if step not in self.cuts:
            known = ", ".join(map(str, sorted(self.cuts))) or "none"
            raise NotFound(f"table {table!r}: consumer group {self.name!r} has no cut at step "
                           f"{step} (cuts: {known})")

    def resume(self, step: int) -> None:
        c = self.cuts[step]
        self.position = c["position"]
        self.inflight_ids = np.array(c["inflight"], dtype=np.uint64)
        self.deadlines = np.zeros(len(self.inflight_ids))  # due now: redelivered first
        self.cuts = {s: v for s, v in self.cuts.items() if s <= step}

    # -- persistence --------------------------------------------------------------------

    def to_dict(self, clock_now: float) -> dict[str, Any]:
        """Plain state; deadlines as wall-clock times (the monotonic clock restarts)."""
        wall = time.time() - clock_now
        return {"name": self.name, "start": self.start, "position": self.position,
                "inflight": self.inflight_ids.tolist(), "deadlines": (self.deadlines + wall).tolist(),
                "delivered": self.delivered, "redelivered": self.redelivered, "acked": self.acked,
                "cuts": {str(k): v for k, v in self.cuts.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any], clock_now: float) -> "ConsumerGroup":
        g = cls(d["name"], d["start"])
        g.position = d["position"]
        g.inflight_ids = np.array(d["inflight"], dtype=np.uint64)
        g.deadlines = np.array(d["deadlines"], dtype=np.float64) - (time.time() - clock_now)
        g.delivered, g.redelivered, g.acked = d["delivered"], d["redelivered"], d["acked"]
        g.cuts = {int(k): v for k, v in d["cuts"].items()}
        return g


class Consumers:
    """A table's consumer groups by name, and (volatile tables) its training manifests.

    The table drives it as it drives a selector, under its lock: it asks what a group may
    be delivered (``expired``, then its position), journals the choice, then applies it
    (``ConsumerGroup.deliver``, ``ack``, ``cut``, ``resume``). ``clock`` is the table's
    monotonic clock, which times visibility deadlines.
    """

    MANIFESTS_IN_MEMORY = 10_000  # steps a volatile table remembers

    def __init__(self, clock) -> None:
        self.clock = clock
        self._groups: dict[str, ConsumerGroup] = {}
        self._manifests: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, name: str) -> bool:
        return name in self._groups

    def __getitem__(self, name: str) -> ConsumerGroup:
        return self._groups[name]

    def get(self, name: str) -> ConsumerGroup | None:
        return self._groups.get(name)

    def items(self):
        return self._groups.items()

    def add(self, group: ConsumerGroup) -> ConsumerGroup:
        self._groups[group.name] = group
        return group

    # -- manifests of a volatile table (a durable one keeps them in its journal) ------------

    def add_manifest(self, step: int, ids: np.ndarray, versions: np.ndarray) -> None:
        """What one sample for ``step`` returned (several samples of a step add up)."""
        self._manifests.setdefault(step, []).append((ids, versions))
        while len(self._manifests) > self.MANIFESTS_IN_MEMORY:
            del self._manifests[next(iter(self._manifests))]

    def set_manifest(self, step: int, ids: np.ndarray, versions: np.ndarray) -> None:
        """A training cut's manifest, replacing what ``step`` had."""
        self._manifests[step] = [(ids, versions)]

    def drop_manifests_after(self, step: int) -> None:
        self._manifests = {s: m for s, m in self._manifests.items() if s <= step}

    def manifest(self, step: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
        return self._manifests.get(step)

    # -- snapshots ------------------------------------------------------------------

    def to_dicts(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [g.to_dict(now) for g in self._groups.values()]

    def load(self, dicts: list[dict[str, Any]]) -> None:
        now = self.clock()
        self._groups = {d["name"]: ConsumerGroup.from_dict(d, now) for d in dicts}
