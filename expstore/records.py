"""The kinds of record in a durable table's journal: one frozen dataclass per kind, its
fields the record's schema, its ``replay`` beside it.

A live call builds a record and hands it to ``Table.journal`` under the table lock,
before it applies the change (so a failed write changes nothing); ``recovery.restore``
decodes each record after the latest snapshot (``decode``) and calls its ``replay``,
which applies the same change through the same table methods (journal off). Records hold
effects, never requests ("these ids were sampled"), so replay needs no randomness.

On disk a record is ``journal.pack(kind, fields)``: the field names below are the
format; a field added later has a default, for records written before it. Arrays are
numpy arrays, string lists Python lists, the rest JSON scalars.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .pacing import Reservation
from . import quarantine  # the module: quarantine.py journals Quarantined records

if TYPE_CHECKING:
    import pyarrow as pa

    from .table import Table

_ROWS = ("chunk", "row", "priority", "policy_version", "inserted_at", "group_size", "reward")


def _slots(table: "Table", ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slots, live): the index slots of ``ids`` (-1 where none) and which are live; an
    item a record names may have left since (replay applies what is still there)."""
    slots = table.parts.index.lookup(ids)
    return slots, slots >= 0


def _remove(table: "Table", ids: np.ndarray, reason: str) -> None:
    """Remove the live items among ``ids``."""
    slots, live = _slots(table, ids)
    table.remove_slots(slots[live], reason)


class Record:
    """One journal record. ``kind`` names it on disk; fields listed in ``optional`` are
    left out of the record when None (older records lack them)."""

    kind: ClassVar[str]
    optional: ClassVar[tuple[str, ...]] = ()

    def fields(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.optional:
                continue
            out[f.name] = value
        return out

    @classmethod
    def decode(cls, fields: dict[str, Any]) -> "Record":
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})

    def replay(self, table: "Table") -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Inserted(Record):
    """New items (``ids``; ``stored`` false: stale or late, removed at once) after the
    remover's ``victims`` left; one value per new item in each index column."""

    kind = "insert"
    optional = ("episode", "data_version", "reservations")
    ids: np.ndarray
    stored: np.ndarray
    keys: list | None
    groups: list | pa.ChunkedArray | None  # an Arrow column when written, a list when read back
    tasks: list | pa.ChunkedArray | None
    victims: np.ndarray
    chunk: np.ndarray
    row: np.ndarray
    priority: np.ndarray
    policy_version: np.ndarray
    inserted_at: np.ndarray
    group_size: np.ndarray
    reward: np.ndarray
    insert_durability: str | None = None  # records before it: none
    episode: np.ndarray | None = None
    data_version: np.ndarray | None = None
    reservations: np.ndarray | None = None  # pacing: the rows' reservation ids

    def index_rows(self) -> dict[str, np.ndarray]:
        rows = {name: getattr(self, name) for name in _ROWS}
        for name in ("episode", "data_version"):
            if getattr(self, name) is not None:
                rows[name] = getattr(self, name)
        return rows

    def replay(self, table: "Table") -> None:
        _remove(table, self.victims, "max_size")
        table.add_items(self.ids, self.index_rows(), self.groups, self.tasks, self.keys, self.stored)
        if self.reservations is not None:
            table.parts.pacing.settle(self.reservations)
        table.parts.placement.replay_written(self.chunk, self.insert_durability)


@dataclass(frozen=True)
class Removed(Record):
    kind = "remove"
    ids: np.ndarray
    reason: str

    def replay(self, table: "Table") -> None:
        _remove(table, self.ids, self.reason)


@dataclass(frozen=True)
class Sampled(Record):
    """A sample's items (repeated for draws with replacement); ``n`` rows returned."""

    kind = "sampled"
    ids: np.ndarray
    n: int

    def replay(self, table: "Table") -> None:
        slots, live = _slots(table, self.ids)
        np.add.at(table.parts.index["times_sampled"], slots[live], 1)
        table.count_samples(int(self.n))


@dataclass(frozen=True)
class PrioritySet(Record):
    kind = "priority"
    ids: np.ndarray
    priorities: np.ndarray

    def replay(self, table: "Table") -> None:
        slots, live = _slots(table, self.ids)
        table.set_priorities(slots[live], self.priorities[live])


@dataclass(frozen=True)
class GroupsTimedOut(Record):
    kind = "group_timeout"
    groups: list
    action: str  # release | drop

    def replay(self, table: "Table") -> None:
        table.settle_groups(self.groups, self.action)


@dataclass(frozen=True)
class VersionSet(Record):
    kind = "version"
    version: int

    def replay(self, table: "Table") -> None:
        table.policy_version = int(self.version)


@dataclass(frozen=True)
class Compacted(Record):
    """Live items ``ids`` (in chunk, row order) rewritten into ``chunk``."""

    kind = "compact"
    ids: np.ndarray
    chunk: int

    def replay(self, table: "Table") -> None:
        ix = table.parts.index
        slots, live = _slots(table, self.ids)
        ix["chunk"][slots[live]] = int(self.chunk)
        ix["row"][slots[live]] = np.flatnonzero(live)
        table.parts.placement.replay_written([int(self.chunk)], "wal")


@dataclass(frozen=True)
class Demoted(Record):
    """Chunks moved to the remote tier (``Placement.demotion_record``)."""

    kind = "demote"
    chunks: np.ndarray
    rows: np.ndarray
    nbytes: np.ndarray

    def replay(self, table: "Table") -> None:
        table.parts.placement.replay_demoted(self.chunks, self.rows, self.nbytes)


@dataclass(frozen=True)
class Archived(Record):
    """Chunks whose archived rows are in the archive dataset (``nbytes`` each), then freed."""

    kind = "archived"
    optional = ("nbytes",)
    chunks: np.ndarray
    nbytes: np.ndarray | None = None  # records before retention: none

    def replay(self, table: "Table") -> None:
        table.parts.archive.done(self.chunks.tolist())
        if table.parts.retention is not None:
            table.parts.retention.archived(self.chunks.tolist(), self.nbytes)


@dataclass(frozen=True)
class ArchiveExpired(Record):
    """Archive fragments deleted past the total retention window (retention.py)."""

    kind = "archive_expired"
    chunks: np.ndarray

    def replay(self, table: "Table") -> None:
        table.parts.retention.deleted(self.chunks.tolist())


# -- paced admission (pacing.py) ------------------------------------------------------

@dataclass(frozen=True)
class Reserved(Record):
    """A reservation granted: ``n`` rows, its lease ending at ``deadline`` (Unix seconds)."""

    kind = "reserve"
    id: int
    n: int
    deadline: float
    version: int

    def replay(self, table: "Table") -> None:
        table.parts.pacing.grant(Reservation(int(self.id), int(self.n), float(self.deadline), int(self.version)))


@dataclass(frozen=True)
class ReservationReleased(Record):
    """A reservation's unused rows given back: ``reason`` released or expired."""

    kind = "release"
    id: int
    reason: str

    def replay(self, table: "Table") -> None:
        table.parts.pacing.release(int(self.id), self.reason)


@dataclass(frozen=True)
class Quarantined(Record):
    kind = "quarantine"
    ids: np.ndarray
    chunk: int
    tier: str
    reason: str

    def replay(self, table: "Table") -> None:
        table.parts.quarantine.add(quarantine.Event(int(self.chunk), self.tier, self.reason), self.ids)
        if table.parts.archive is not None:  # removed items' rows it will not archive
            table.parts.archive.drop_ids(int(self.chunk), self.ids)
        _remove(table, self.ids, "quarantined")


# -- consumer groups (streams.py) -----------------------------------------------------

@dataclass(frozen=True)
class GroupCreated(Record):
    kind = "group"
    group: str
    position: int

    def replay(self, table: "Table") -> None:
        table.parts.consumers.create(self.group, int(self.position))


@dataclass(frozen=True)
class Forgotten(Record):
    """In-flight ids of a group whose items left the table."""

    kind = "forget"
    group: str
    ids: np.ndarray

    def replay(self, table: "Table") -> None:
        table.parts.consumers[self.group].forget(self.ids)


@dataclass(frozen=True)
class Delivered(Record):
    """A stream delivery; ``deadline`` on the wall clock (the monotonic one restarts)."""

    kind = "deliver"
    group: str
    fresh: np.ndarray
    again: np.ndarray
    deadline: float

    def replay(self, table: "Table") -> None:
        deadline = float(self.deadline) - time.time() + table.parts.consumers.clock()
        table.parts.consumers[self.group].deliver(self.fresh.copy(), self.again, deadline)


@dataclass(frozen=True)
class Acked(Record):
    kind = "ack"
    group: str
    ids: np.ndarray

    def replay(self, table: "Table") -> None:
        table.parts.consumers[self.group].ack(self.ids)


@dataclass(frozen=True)
class Nacked(Record):
    """Delivered ids handed back to the group: due again, redelivered first."""

    kind = "nack"
    group: str
    ids: np.ndarray

    def replay(self, table: "Table") -> None:
        consumers = table.parts.consumers
        consumers[self.group].release(self.ids, consumers.clock())


@dataclass(frozen=True)
class Cut(Record):
    """A training cut; its manifest goes in the same write (``Journal.append``)."""

    kind = "cut"
    group: str
    step: int
    tag: str
    ids: np.ndarray

    def replay(self, table: "Table") -> None:
        g = table.parts.consumers[self.group]
        g.ack(self.ids)
        g.cut(int(self.step), self.tag)


@dataclass(frozen=True)
class Resumed(Record):
    """A group rewound to its cut at ``step``; later manifests are dropped in the same write."""

    kind = "resume"
    group: str
    step: int

    def replay(self, table: "Table") -> None:
        table.parts.consumers[self.group].resume(int(self.step))


KINDS: dict[str, type[Record]] = {cls.kind: cls for cls in (
    Inserted, Removed, Sampled, PrioritySet, GroupsTimedOut, VersionSet, Compacted, Demoted, Archived,
    ArchiveExpired, Reserved, ReservationReleased, Quarantined, GroupCreated, Forgotten, Delivered, Acked, Nacked,
    Cut, Resumed)}


def decode(kind: str, fields: dict[str, Any]) -> Record:
    """The record a journal entry holds (``Journal.load``'s (kind, fields))."""
    return KINDS[kind].decode(fields)
