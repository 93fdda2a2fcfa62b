"""The archive of an ``archive = true`` table: items that left the sampling window, kept
on the remote tier for queries and audits instead of being deleted.

A removed item's row stays where it is until its chunk has no live item left; the chunk
is then queued instead of freed, and the mover copies its archived rows (with the
server's ``_item_id`` and ``_removed`` reason columns) as one fragment of the archive
dataset ``<remote>/tables/<table>.archive.lance`` (recording the fragment's checksums,
as for chunks on the remote tier), logs that, and frees the chunk. Which
rows of a chunk are archived is derived from the journal's removal records, so a restart
re-queues exactly the chunks whose upload had not been logged. Not thread-safe: the table
holds its lock.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

ARCHIVE_SUFFIX = ".archive"


class Archive:
    def __init__(self, tier, checksums=None) -> None:
        self.tier = tier  # a RemoteTier for "<table>.archive"
        self.checksums = checksums  # its fragments' RemoteChecksums, checked by every scan
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

    def wanted(self, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The chunk's archived rows, in row order, with their item ids and removal reasons."""
        parts = self._rows[chunk]
        rows = np.concatenate([r for r, _, _ in parts])
        ids = np.concatenate([i for _, i, _ in parts])
        reasons = np.concatenate([np.full(len(r), why, dtype=object) for r, _, why in parts])
        order = np.argsort(rows, kind="stable")
        return rows[order], ids[order], reasons[order]

    @staticmethod
    def annotate(rows: pa.RecordBatch, ids: np.ndarray, reasons: np.ndarray) -> pa.RecordBatch:
        """The archived rows (as ``wanted`` lists them) with their ids and reasons."""
        out = rows.append_column("_item_id", pa.array(ids, pa.uint64()))
        return out.append_column("_removed", pa.array(reasons, pa.string()))

    def drop_rows(self, chunk: int, ranges: list[tuple[int, int]] | None) -> np.ndarray:
        """Give up the chunk's archived rows in ``ranges`` (None: all), damaged; returns
        their item ids. A chunk left with none is no longer waiting."""
        keep, gone = [], []
        for rows, ids, why in self._rows.get(chunk, []):
            lost = np.ones(len(rows), dtype=bool) if ranges is None else \
                np.any([(rows >= lo) & (rows < hi) for lo, hi in ranges], axis=0)
            gone.append(ids[lost])
            if not lost.all():
                keep.append((rows[~lost], ids[~lost], why))
        self._set(chunk, keep)
        return np.concatenate(gone) if gone else np.zeros(0, np.uint64)

    def drop_ids(self, chunk: int, item_ids: np.ndarray) -> None:
        """``drop_rows`` by item id (journal replay)."""
        keep = [(r[~np.isin(i, item_ids)], i[~np.isin(i, item_ids)], why) for r, i, why in self._rows.get(chunk, [])]
        self._set(chunk, [k for k in keep if len(k[0])])

    def _set(self, chunk: int, parts: list) -> None:
        if parts:
            self._rows[chunk] = parts
        elif chunk in self._rows:
            del self._rows[chunk]
            self.queue = [c for c in self.queue if c != chunk]

    def done(self, chunks: list[int]) -> None:
        for c in chunks:
            self._rows.pop(c, None)
        gone = set(chunks)
        self.queue = [c for c in self.queue if c not in gone]

    def pending(self) -> list[int]:
        return list(self._rows)
