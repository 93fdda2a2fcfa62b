"""Reading a table's rows: planned under the table lock, read and copied outside it.

``Reader.plan`` (lock held) takes the rows' facts from the index and a read plan from the
placement: the resident chunks' batches, and a pin on every other chunk, so no chunk it
needs is deleted before it is read. ``Reader.gather`` (no lock) fetches the pinned chunks
(SSD blocks in one multi-get, remote fragments whole, every byte verified), copies the
rows out once (gather.take_rows), then unpins under the lock again and lets the table
read ahead what the cache has room for. Damage met on the way is handed to the table
(``Table.quarantine_damage``) and fails the call with DataLoss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import pyarrow as pa

from . import group_timeouts
from .errors import DataLoss, InvalidArgument
from .gather import take_rows
from .group_timeouts import GroupTimeouts
from .index import ItemIndex
from .placement import Placement, ReadPlan

if TYPE_CHECKING:
    from .table import Table


@dataclass(frozen=True)
class Rows:
    """Rows out of a table (Sample, Stream, Get) with their per-row facts, row-aligned."""

    data: pa.RecordBatch
    item_ids: np.ndarray
    priorities: np.ndarray
    times_sampled: np.ndarray
    policy_versions: np.ndarray
    probabilities: np.ndarray | None = None
    weights: np.ndarray | None = None


@dataclass(frozen=True)
class PlannedRows:
    """Rows to read: their facts, taken under the lock, and the placement's read plan."""

    plan: ReadPlan
    item_ids: np.ndarray
    priorities: np.ndarray
    times_sampled: np.ndarray
    policy_versions: np.ndarray
    probabilities: np.ndarray | None
    weights: np.ndarray | None
    released: np.ndarray | None = None  # bool per row: its group was released partial
    group_sizes: np.ndarray | None = None  # the index's group_size per row (corrected on release)


class Reader:
    def __init__(self, table: "Table", index: ItemIndex, placement: Placement,
                 timeouts: GroupTimeouts | None) -> None:
        self.table, self.index, self.placement, self.timeouts = table, index, placement, timeouts

    def plan(self, slots: np.ndarray, probabilities=None, weights=None) -> PlannedRows:
        """Per-row facts and a read plan (resident batches, other chunks pinned), taken
        under the lock (``gather`` them after it)."""
        ix = self.index
        released = None if self.timeouts is None else self.timeouts.released(ix["group"][slots])
        return PlannedRows(
            plan=self.placement.plan(ix["chunk"][slots], ix["row"][slots]),
            item_ids=ix["id"][slots], priorities=ix["priority"][slots],
            times_sampled=ix["times_sampled"][slots], policy_versions=ix["policy_version"][slots],
            probabilities=probabilities, weights=weights, released=released,
            group_sizes=None if released is None else ix["group_size"][slots])

    def gather(self, planned: PlannedRows, columns: list[str] | None = None) -> Rows:
        """Read and copy the rows (``columns`` of them) out of their chunks (no lock held:
        chunks are immutable and the plan pinned those not in memory), then unpin."""
        t, plan = self.table, planned.plan
        try:
            try:
                batches, keys, rows = self.placement.fetch(plan)
            except DataLoss as e:
                with t.lock:
                    n = t.quarantine_damage(e)
                raise DataLoss(f"table {t.name!r}: {e}; {n} items stored there are quarantined: later "
                               f"calls do not return them", damage=e.damage) from None
            schema = t.schema
            if columns is not None:  # select first: only these columns are copied
                batches = {k: b.select(columns) for k, b in batches.items()}
                schema = pa.schema([t.schema.field(c) for c in columns])
            data = take_rows(batches, keys, rows, schema)
            if planned.released is not None:
                data = group_timeouts.with_released(data, planned.released, planned.group_sizes)
        finally:
            if plan.pinned:
                with t.lock:
                    self.placement.finish(plan)
                    t.read_ahead([c for c in plan.pinned if c not in plan.fetched], if_room=True)
        return Rows(data=data, item_ids=planned.item_ids, priorities=planned.priorities,
                    times_sampled=planned.times_sampled, policy_versions=planned.policy_versions,
                    probabilities=planned.probabilities, weights=planned.weights)

    def scan(self, names: list[str], columns: Sequence[str] | None, *, policy_versions: tuple, inserted: tuple
             ) -> Iterator[pa.RecordBatch]:
        """``Table.scan``: the live items within the bounds (``(min, max)`` policy version,
        inclusive; ``(after, before)`` inserted_at, exclusive; None: unbounded), pruned
        with the index under the lock, then read one chunk at a time without it. A
        generator: nothing is checked or pinned until the first batch is asked for."""
        columns = list(names if columns is None else columns)
        unknown = [c for c in columns if c not in names]
        if unknown:
            raise InvalidArgument(f"table {self.table.name!r}: no column {unknown[0]!r} (columns: {', '.join(names)})")
        (lo_v, hi_v), (after, before) = policy_versions, inserted
        with self.table.lock:
            self.table.tick()
            ix = self.index
            slots = ix.live_slots()
            keep = np.ones(len(slots), dtype=bool)
            pv, at = ix["policy_version"][slots], ix["inserted_at"][slots]
            for bound, ok in ((lo_v, lambda b: pv >= b), (hi_v, lambda b: pv <= b),
                              (after, lambda b: at > b), (before, lambda b: at < b)):
                if bound is not None:
                    keep &= ok(bound)
            parts = self.plan_by_chunk(slots[keep])
        yield from self.read_by_chunk(parts, columns)

    def plan_by_chunk(self, slots: np.ndarray) -> list[tuple[PlannedRows, np.ndarray, str]]:
        """Plans for a scan of live items (lock held): one per chunk, in chunk and row
        order, with the items' ``inserted_at`` and the tier their chunk is read from."""
        ix = self.index
        slots = slots[np.lexsort((ix["row"][slots], ix["chunk"][slots]))]
        chunks = ix["chunk"][slots]
        starts = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1]]) if len(chunks) else np.zeros(0, np.int64)
        ends = np.append(starts[1:], len(chunks))
        return [(self.plan(slots[lo:hi]), ix["inserted_at"][slots[lo:hi]].copy(),
                 self.placement.where(int(chunks[lo]))) for lo, hi in zip(starts.tolist(), ends.tolist())]

    def read_by_chunk(self, parts: list[tuple[PlannedRows, np.ndarray, str]],
                      columns: list[str]) -> Iterator[pa.RecordBatch]:
        """A scan's batches, one chunk at a time (so memory holds one chunk): the
        ``columns`` plus ``item_id``, ``priority``, ``times_sampled``, ``inserted_at`` and
        ``tier``. An abandoned scan unpins what it did not read."""
        try:
            while parts:
                planned, inserted_at, tier = parts.pop(0)
                rows = self.gather(planned, columns)
                data = rows.data
                for name, values in (("item_id", pa.array(rows.item_ids, pa.uint64())),
                                     ("priority", pa.array(rows.priorities, pa.float64())),
                                     ("times_sampled", pa.array(rows.times_sampled, pa.int64())),
                                     ("inserted_at", pa.array(inserted_at, pa.float64())),
                                     ("tier", pa.array([tier] * len(inserted_at), pa.string()))):
                    data = data.append_column(name, values)
                yield data
        finally:
            with self.table.lock:
                for planned, _, _ in parts:
                    self.placement.finish(planned.plan)
