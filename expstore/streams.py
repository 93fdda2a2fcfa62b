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
from typing import TYPE_CHECKING, Any

import numpy as np

from . import names
from .admission import Admission, Wait
from .errors import InvalidArgument, NotFound
from .records import Acked, Cut, Delivered, Forgotten, GroupCreated, Nacked, Resumed

if TYPE_CHECKING:
    from .table import Rows, Table

DEFAULT_VISIBILITY_TIMEOUT = 60.0


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

    def release(self, ids: np.ndarray, now: float) -> int:
        """Make delivered ids due again at ``now`` (a nack): the group's next reads
        redeliver them first, oldest first. Returns how many were in flight (acked ones
        stay acked). Call check_ack first."""
        hit = np.isin(self.inflight_ids, ids)
        self.deadlines[hit] = np.minimum(self.deadlines[hit], now)
        return int(hit.sum())

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

    def create(self, name: str, position: int) -> ConsumerGroup:
        """A new group whose first read is the item ``position`` (or the next one after)."""
        g = self._groups[name] = ConsumerGroup(name, position)
        return g

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


class Streams:
    """A table's Stream, Ack, Nack, CommitCut, Resume and Manifest calls (``Table.stream`` and
    the others hand them here). Each takes the table lock (``Table.lock``), asks the
    consumer group what it may deliver, journals that (``Table.journal``), applies it,
    and reads the rows after the lock is released, as a sample does."""

    def __init__(self, table: "Table", consumers: Consumers) -> None:
        self.table = table
        self.consumers = consumers
        self.name = table.name

    def stream(self, group: str, n: int, timeout: float | None, visibility_timeout: float, start: str) -> "Rows":
        with Admission(self.table, "stream", timeout, clock=self.consumers.clock) as adm:
            while isinstance(outcome := self.try_stream(group, n, visibility_timeout, start), Wait):
                self.table.wait_for_change(outcome.epoch, adm.limit(outcome))
        return outcome

    def try_stream(self, group: str, n: int, visibility_timeout: float, start: str) -> "Rows | Wait":
        t, index = self.table, self.table.parts.index
        if n < 1:
            raise InvalidArgument(f"table {self.name!r}: batch_size must be >= 1, got {n}")
        self._check_name(group)
        if visibility_timeout <= 0:
            raise InvalidArgument(f"table {self.name!r}: visibility_timeout must be > 0")
        if start not in ("earliest", "latest"):
            raise InvalidArgument(f"table {self.name!r}: start must be 'earliest' or 'latest', got {start!r}")
        with t.lock:
            g = self.consumers.get(group) or self._new_group(group, start)
            t.check_open()
            now = self.consumers.clock()
            again = g.expired(now, n)
            again_slots = index.lookup(again)
            if (again_slots < 0).any():
                t.journal(Forgotten(group=group, ids=again[again_slots < 0]))
                g.forget(again[again_slots < 0])
            again, again_slots = again[again_slots >= 0], again_slots[again_slots >= 0]
            fresh_slots = index.slots_from(g.position, n - len(again))
            if not len(again) and not len(fresh_slots):
                nd = g.next_deadline()
                return Wait(f"consumer group {group!r} is caught up", t.epoch,
                            retry_after=None if nd is None else max(0.0, nd - now))
            fresh = index["id"][fresh_slots]
            t.journal(Delivered(group=group, fresh=fresh, again=again, deadline=time.time() + visibility_timeout))
            g.deliver(fresh, again, now + visibility_timeout)
            slots = np.concatenate([again_slots, fresh_slots])
            t.counters["stream_deliveries"] += len(slots)
            t.record_staleness("stream", slots)
            plan = t.plan_read(slots)
            if t.parts.placement.durable:  # the chunks of the next 2n unread items
                t.read_ahead(np.unique(index["chunk"][index.slots_from(g.position, 2 * n)]).tolist())
            t.changed()
        return t.read(plan)

    def ack(self, group: str, ids: np.ndarray) -> tuple[int, int]:
        t = self.table
        with t.lock:
            g = self._group(group)
            g.check_ack(ids, self.name)
            t.journal(Acked(group=group, ids=ids))
            result = g.ack(ids)
            t.changed()
            return result

    def nack(self, group: str, ids: np.ndarray) -> int:
        t = self.table
        with t.lock:
            g = self._group(group)
            g.check_ack(ids, self.name)
            t.journal(Nacked(group=group, ids=ids))
            released = g.release(ids, self.consumers.clock())
            t.changed()
            return released

    def commit_cut(self, group: str, step: int, ids: np.ndarray, tag: str) -> int:
        t = self.table
        if step < 0:
            raise InvalidArgument(f"table {self.name!r}: step must be >= 0, got {step}")
        durability = t.spec.durability
        with t.lock:
            g = self.consumers.get(group)
            if g is None and not len(ids):
                g = self._new_group(group, "earliest")
            g = g or self._group(group)
            g.check_ack(ids, self.name)
            versions = self._versions_of(ids)
            t.journal(Cut(group=group, step=step, tag=tag, ids=ids), durability, manifest=(step, ids, versions))
            if t.parts.journal is None:
                self.consumers.set_manifest(step, ids, versions)
            acked, _ = g.ack(ids)
            g.cut(step, tag)
            t.changed()
        if durability == "fsync":
            t.storage.db.sync()
        return acked

    def resume(self, group: str, step: int) -> dict[str, int]:
        t = self.table
        with t.lock:
            g = self._group(group)
            g.check_cut(step, self.name)
            t.journal(Resumed(group=group, step=step), drop_manifests_after=step)
            if t.parts.journal is None:
                self.consumers.drop_manifests_after(step)
            g.resume(step)
            t.changed()
            return {"position": g.position, "inflight": len(g.inflight_ids)}

    def manifest(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        t = self.table
        with t.lock:
            parts = self.consumers.manifest(step)
            if parts is None and t.parts.journal is not None:
                parts = t.parts.journal.manifest(step)
            if not parts:
                raise NotFound(f"table {self.name!r}: no manifest for step {step} "
                               f"(sample with step={step} to record one)")
            ids, versions = zip(*parts)
            return np.concatenate(ids), np.concatenate(versions)

    def record_manifest(self, step: int, slots: np.ndarray) -> None:
        """What a sample for ``step`` returned (lock held)."""
        index, journal = self.table.parts.index, self.table.parts.journal
        entry = (index["id"][slots].copy(), index["policy_version"][slots].copy())
        if journal is not None:
            journal.add_manifest(step, *entry)
        else:
            self.consumers.add_manifest(step, *entry)

    def _new_group(self, group: str, start: str) -> ConsumerGroup:
        """A consumer group reading from the earliest item or after the newest (lock held)."""
        self._check_name(group)
        position = 1 if start == "earliest" else self.table.parts.index.next_id
        self.table.journal(GroupCreated(group=group, position=position))
        return self.consumers.create(group, position)

    def _versions_of(self, ids: np.ndarray) -> np.ndarray:
        """Policy versions of items by id; -1 for an id no longer in the table."""
        index = self.table.parts.index
        slots = index.lookup(ids)
        versions = np.full(len(ids), -1, dtype=np.int64)
        versions[slots >= 0] = index["policy_version"][slots[slots >= 0]]
        return versions

    def _group(self, group: str) -> ConsumerGroup:
        g = self.consumers.get(group)
        if g is None:
            self._check_name(group)
            raise NotFound(f"table {self.name!r}: no consumer group {group!r}")
        return g

    def _check_name(self, group: str) -> None:
        try:
            names.check_consumer_group(group)
        except InvalidArgument as e:
            raise InvalidArgument(f"table {self.name!r}: {e}") from None
