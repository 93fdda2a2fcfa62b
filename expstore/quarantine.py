"""Items whose stored bytes failed verification: out of the table for good, and remembered.

A read that meets damage (a block or fragment whose checksum fails, or that does not
decode) raises DataLoss naming the chunks and rows it found. The table then quarantines
the live items stored there: they leave the sampler, the remover, the streams and the
index, like a removal (reason ``quarantined``), and this registry keeps each damage event:
the chunk, the tier it was read from, why, and the ids of the items it took. The table
journals every event and snapshots the registry, so quarantined items stay quarantined
after a restart: never served, never silently gone from the counts. A damaged archive
fragment is an event without items (its rows had already left the table).
``Quarantine`` is the registry; ``Quarantiner`` does the moving for a table.

Not thread-safe: the table holds its lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from . import records  # the module: records.py replays Quarantined into an Event of this one
from .errors import DataLoss

if TYPE_CHECKING:
    from .index import ItemIndex
    from .placement import Placement
    from .table import Table

log = logging.getLogger("expstore.table")


@dataclass(frozen=True)
class Event:
    chunk: int
    tier: str    # where the damage was read: ssd, remote or archive
    reason: str  # the verification failure, as reported


class Quarantine:
    def __init__(self) -> None:
        self._events: list[Event] = []
        self._of_item: dict[int, int] = {}  # item id -> index of its event

    def __len__(self) -> int:
        """Items quarantined."""
        return len(self._of_item)

    @property
    def chunks(self) -> int:
        """Damaged chunks (and archive fragments) found."""
        return len({(e.tier, e.chunk) for e in self._events})

    def add(self, event: Event, ids: np.ndarray) -> None:
        self._events.append(event)
        self._of_item.update(dict.fromkeys(ids.tolist(), len(self._events) - 1))

    def chunks_on(self, tier: str) -> frozenset[int]:
        """The chunks found damaged on ``tier``."""
        return frozenset(e.chunk for e in self._events if e.tier == tier)

    def event_of(self, item_id: int) -> Event | None:
        i = self._of_item.get(item_id)
        return None if i is None else self._events[i]

    def ids(self) -> np.ndarray:
        """The quarantined item ids, in id order."""
        return np.sort(np.fromiter(self._of_item, dtype=np.uint64, count=len(self._of_item)))

    @staticmethod
    def as_rows(ids: np.ndarray, fields: list[pa.Field]) -> pa.RecordBatchReader:
        """Quarantined items as rows: ``_item_id`` and the payload ``fields``, all null
        (their stored bytes are damaged)."""
        arrays = [pa.nulls(len(ids), f.type) for f in fields] + [pa.array(ids, pa.uint64())]
        schema = pa.schema(fields + [pa.field("_item_id", pa.uint64())])
        return pa.RecordBatchReader.from_batches(schema, [pa.RecordBatch.from_arrays(arrays, schema=schema)])

    def to_fields(self) -> dict:
        """The registry as journal snapshot fields."""
        return {"quarantine_ids": np.fromiter(self._of_item, dtype=np.uint64, count=len(self._of_item)),
                "quarantine_event": np.fromiter(self._of_item.values(), dtype=np.int64, count=len(self._of_item)),
                "quarantine_chunks": np.array([e.chunk for e in self._events], dtype=np.int64),
                "quarantine_tiers": [e.tier for e in self._events],
                "quarantine_reasons": [e.reason for e in self._events]}

    def restore(self, fields: dict) -> None:
        """Load what ``to_fields`` wrote (snapshots from before quarantine have none)."""
        if "quarantine_ids" not in fields:
            return
        chunks, tiers, reasons = fields["quarantine_chunks"].tolist(), fields["quarantine_tiers"], fields["quarantine_reasons"]
        self._events = [Event(int(c), t, r) for c, t, r in zip(chunks, tiers, reasons)]
        self._of_item = dict(zip(fields["quarantine_ids"].tolist(), fields["quarantine_event"].tolist()))


class Quarantiner:
    """Moves a table's damaged items into quarantine: the live items stored where a read
    found damage are journaled (``Quarantined``), remembered in the registry and removed
    from the table, and a later call naming one of them fails with DATA_LOSS saying why.
    Apart from ``Table`` because damage is met by every reader (reads.py, movement.py,
    recovery.py), which hand it here. Every method runs with the table's lock held."""

    def __init__(self, table: "Table", index: "ItemIndex", placement: "Placement", registry: Quarantine) -> None:
        self.table, self.index, self.placement, self.registry = table, index, placement, registry

    def damage(self, error: DataLoss) -> int:
        """Quarantine the live items stored where ``error`` found damage: for each damaged
        chunk, the items in its damaged rows (all of them when the whole chunk is).
        Returns how many items were quarantined."""
        total = 0
        for chunk, ranges in error.damage.items():
            tier = self.placement.home(chunk) if self.placement.durable else "memory"
            total += self._items(chunk, ranges, tier, str(error))
        if total:
            self.table.changed()
        return total

    def _items(self, chunk: int, ranges: list[tuple[int, int]] | None, tier: str, reason: str) -> int:
        ix = self.index
        live = ix.live_slots()
        slots = live[ix["chunk"][live] == chunk]
        if ranges is not None:
            rows = ix["row"][slots]
            inside = np.zeros(len(slots), dtype=bool)
            for lo, hi in ranges:
                inside |= (rows >= lo) & (rows < hi)
            slots = slots[inside]
        if len(slots) == 0:
            return 0
        self.event(chunk, tier, reason, ix["id"][slots].copy())
        self.table.remove_slots(slots, "quarantined", log=False)
        return len(slots)

    def event(self, chunk: int, tier: str, reason: str, ids: np.ndarray) -> None:
        """Journal and remember one damage event (the caller removes its live items)."""
        self.table.journal(records.Quarantined(ids=ids, chunk=chunk, tier=tier, reason=reason))
        event = Event(chunk, tier, reason)
        self.registry.add(event, ids)
        log.error("table %r: chunk %d on the %s tier is damaged; %d items quarantined: %s",
                  self.table.name, event.chunk, event.tier, len(ids), event.reason)

    def check_not_quarantined(self, ids: np.ndarray) -> None:
        """DATA_LOSS naming the first of ``ids`` that is quarantined, and why."""
        for item_id in ids.tolist():
            event = self.registry.event_of(item_id)
            if event is not None:
                raise DataLoss(f"table {self.table.name!r}: item {item_id} is quarantined: its chunk "
                               f"{event.chunk} on the {event.tier} tier is damaged ({event.reason})")
