"""The archive of an ``archive = true`` table: items that left the sampling window, kept
on the remote tier for queries and audits instead of being deleted.

A removed item's row stays where it is until its chunk has no live item left; the chunk
is then queued instead of freed, and the mover copies its archived rows (with the
server's ``_item_id`` and ``_removed`` reason columns) as one fragment of the archive
dataset ``<remote>/tables/<table>.archive.lance``, logs that, and frees the chunk. Which
rows of a chunk are archived is derived from the journal's removal records, so a restart
re-queues exactly the chunks whose upload had not been logged. Not thread-safe: the table
holds its lock.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

ARCHIVE_SUFFIX = ".archive"


class Archive:
    def __init__(self, tier) -> None:
        self.tier = tier  # a RemoteTier for "<table>.archive"
        self._rows: dict[int, list[tuple[np.ndarray, np.ndarray, str]]] = {}
        self.queue: list[int] = []

    def __contains__(self, chunk: int) -> bool:
        return chunk in self._rows

    def removed(self, chunks: np.ndarray, rows: np.ndarray, ids: np.ndarray, reason: str) -> None:
        """Items left the table: remember their rows for their chunk's upload."""
        for c in np.unique(chunks).tolist():
            at = chunks == c
            self._rows.setdefault(c, []).append((rows[at], ids[at], reason))

    def freed(self, chunks: list[int]) -> list[int]:
        """Chunks whose last live item left: queue those holding archived rows; returns
        the others (free to delete)."""
        keep = [c for c in chunks if c in self._rows]
        self.queue.extend(keep)
        return [c for c in chunks if c not in self._rows]

    def rows_of(self, chunk: int, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The chunk's archived rows, with their item ids and removal reasons."""
        parts = self._rows[chunk]
        rows = np.concatenate([r for r, _, _ in parts])
        ids = np.concatenate([i for _, i, _ in parts])
        reasons = np.concatenate([np.full(len(r), why, dtype=object) for r, _, why in parts])
        order = np.argsort(rows, kind="stable")
        out = batch.take(pa.array(rows[order]))
        out = out.append_column("_item_id", pa.array(ids[order], pa.uint64()))
        return out.append_column("_removed", pa.array(reasons[order], pa.string()))

    def done(self, chunks: list[int]) -> None:
        for c in chunks:
            self._rows.pop(c, None)
        gone = set(chunks)
        self.queue = [c for c in self.queue if c not in gone]

    def pending(self) -> list[int]:
        return list(self._rows)
