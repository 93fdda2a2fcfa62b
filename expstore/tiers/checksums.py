"""The checksums of a table's chunks on the remote tier, kept in the server's RocksDB.

Lance files carry no checksums: a byte flipped in a fragment on S3 decodes into wrong
tokens without an error. So when the mover puts a chunk (or an archive fragment) on the
remote tier, the tier reads the fragment back, checks that it equals what was written and
returns a CRC32 per column of what it read (``codec.column_checksums``); they are recorded
here, before the chunk's SSD copy is deleted, and every later read of the fragment (whole
for samples, some columns for archive scans) is checked against them. Per column, so that
a scan of a few columns checks what it reads without reading the rest.

Layout: the ``meta`` column family, ``remote/`` table id (4) kind (1: ``c`` chunks, ``a``
archive) chunk id (8) -> the uint32 checksums. A few dozen bytes per chunk, all held in
memory. Not thread-safe: the table holds its lock (or the mover owns the chunks it moves).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from rocksdict import WriteBatch

from .rocks import Database, table_prefix

_PREFIX = b"remote/"
CHUNKS, ARCHIVE = b"c", b"a"


class RemoteChecksums:
    def __init__(self, db: Database, table_id: int, kind: bytes = CHUNKS) -> None:
        self.db = db
        self._prefix = _PREFIX + table_prefix(table_id) + kind
        self._table_prefix = _PREFIX + table_prefix(table_id)
        self._sums: dict[int, np.ndarray] = {}

    def __contains__(self, chunk_id: int) -> bool:
        return chunk_id in self._sums

    def __len__(self) -> int:
        return len(self._sums)

    def get(self, chunk_id: int) -> np.ndarray | None:
        return self._sums.get(chunk_id)

    def load(self) -> None:
        """Read this table's records (at start)."""
        for key, value in self.db.items("meta", self._prefix):
            self._sums[int.from_bytes(key[len(self._prefix):], "big")] = np.frombuffer(value, dtype="<u4")

    def put(self, checksums: dict[int, np.ndarray]) -> None:
        """Record chunks' checksums (a WAL write: before their SSD copies go)."""
        if not checksums:
            return
        wb = WriteBatch(raw_mode=True)
        for c, sums in checksums.items():
            wb.put(self._key(c), np.asarray(sums, dtype="<u4").tobytes(), self.db.handle["meta"])
        self.db.write(wb, "wal")
        self._sums.update(checksums)

    def delete(self, chunk_ids: Iterable[int]) -> None:
        gone = [c for c in chunk_ids if c in self._sums]
        if not gone:
            return
        wb = WriteBatch(raw_mode=True)
        for c in gone:
            wb.delete(self._key(c), self.db.handle["meta"])
        self.db.write(wb, "wal")
        for c in gone:
            del self._sums[c]

    def drop(self) -> None:
        """Delete the records of every kind of this table (DropTable)."""
        wb = WriteBatch(raw_mode=True)
        wb.delete_range(self._table_prefix, self._table_prefix + b"\xff" * 9, self.db.handle["meta"])
        self.db.write(wb, "wal")
        self._sums.clear()

    def _key(self, chunk_id: int) -> bytes:
        return self._prefix + chunk_id.to_bytes(8, "big")
