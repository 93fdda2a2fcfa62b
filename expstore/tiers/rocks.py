"""SSD tier: RocksDB (rocksdict) in the server's data dir.

One database per server, shared by its tables, in three column families::

    chunks   table id (4) | chunk id (8) | block (4)  -> rows [lo, hi) of the chunk (a codec block)
             table id (4) | chunk id (8) | 0xFFFFFFFF -> block row offsets, sizes, the schema
    journal  table id (4) | sequence (8)              -> the table's state changes (journal.py)
    meta     b"table/" name, b"snapshot/" table id, ... -> table records and snapshots

A chunk is stored as blocks of about BLOCK_BYTES (one row when rows are larger): sampling
one cold row reads and decompresses its block (a RocksDB multi-get for a whole batch of
rows), not the whole 8 MiB chunk; 256 KiB blocks decoded 60 MB to return 9 MB. Writes take a
durability level: ``memory`` skips the write-ahead log (lost on a crash until RocksDB
flushes), ``wal`` appends to the log (survives a killed process), ``fsync`` also syncs the
log; ``Database.sync`` is one fsync for every write before it, so concurrent fsync inserts
share it (group commit).

Damage: RocksDB checksums every block it stores and verifies it on read. A read that meets
a damaged block raises DataLoss (``DamagedValues`` names the keys of a multi-get that sit
in damaged blocks, the others are still read), and an iteration that meets one raises
DataLoss instead of ending early, so a reader never mistakes a damaged range for its end.

Disk space: RocksDB stops taking writes for good (until reopened) once a write or a flush
meets a full disk, so writes that store data (``write(..., grows=n)``) are refused first,
while the disk still has room for them twice (the log now, an SST file at the flush) and
for the flush of every memtable, plus ``min_free_bytes``. Deletes are never refused, and
``reclaim`` gives their space back at once: a dropped table's keys would otherwise hold
their log files and SST files until later compactions.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import threading
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
from rocksdict import (Checkpoint, CompactOptions, DBCompressionType, Options, Rdict, ReadOptions, WriteBatch,
                       WriteOptions)

from .. import codec
from ..errors import DataLoss, FailedPrecondition, NotFound, ResourceExhausted, Unavailable

COLUMN_FAMILIES = ("chunks", "journal", "meta")
DURABILITIES = ("memory", "wal", "fsync")
BLOCK_BYTES = 64 << 10
_META_BLOCK = 0xFFFFFFFF


def _options() -> Options:
    o = Options(raw_mode=True)
    o.create_if_missing(True)
    o.create_missing_column_families(True)
    o.set_compression_type(DBCompressionType.none())  # values are zstd already
    return o


class Database:
    """The data dir's RocksDB, opened once per process under an exclusive lock."""

    def __init__(self, path: str | Path, min_free_bytes: int = 0) -> None:
        self.path = Path(path)
        self.min_free_bytes = min_free_bytes
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock(self.path)
        try:
            self._db = Rdict(str(self.path / "rocksdb"), _options(),
                             column_families={cf: _options() for cf in COLUMN_FAMILIES})
        except Exception as e:
            self._lock_file.close()
            raise _translate(e, f"opening {self.path}") from None
        self.cf = {cf: self._db.get_column_family(cf) for cf in COLUMN_FAMILIES}
        self.handle = {cf: self._db.get_column_family_handle(cf) for cf in COLUMN_FAMILIES}
        self._write_options = {}
        for level in DURABILITIES:
            w = WriteOptions()
            w.disable_wal = level == "memory"
            self._write_options[level] = w
        self._space = threading.Lock()  # one growing write at a time between check and write
        self._compacting = threading.Lock()  # close waits for a reclaim in progress

    def write(self, batch: WriteBatch, durability: str = "wal", *, grows: int = 0) -> None:
        """Apply ``batch`` at ``durability``. A batch that stores data passes the ``grows``
        bytes it adds: it is refused (RESOURCE_EXHAUSTED, nothing written) unless the
        disk has room for it (``check_free_space``)."""
        if not grows:
            self._write(batch, durability)
            return
        with self._space:
            self.check_free_space(grows)
            self._write(batch, durability)

    def _write(self, batch: WriteBatch, durability: str) -> None:
        try:
            self._db.write(batch, self._write_options[durability])
        except Exception as e:
            raise _translate(e, "writing to the SSD tier") from None

    def sync(self) -> None:
        """fsync the write-ahead log: every write made before this call is on disk."""
        try:
            self._db.flush_wal(True)
        except Exception as e:
            raise _translate(e, "syncing the SSD tier's log") from None

    def get(self, cf: str, keys: list[bytes]) -> list[bytes | None]:
        """The values of ``keys`` (None where absent), in one multi-get. If some keys sit
        in damaged blocks, raises DamagedValues naming them, with the others' values."""
        try:
            return self.cf[cf].get(keys)
        except Exception as e:
            if not _is_corruption(e):
                raise _translate(e, f"reading the SSD tier ({cf})") from None
        values, damaged = [], {}
        for key in keys:  # the multi-get failed as a whole: find the damaged keys
            try:
                values.append(self.cf[cf].get(key))
            except Exception as e:
                if not _is_corruption(e):
                    raise _translate(e, f"reading the SSD tier ({cf})") from None
                values.append(None)
                damaged[key] = str(e)
        raise DamagedValues(cf, values, damaged)

    def items(self, cf: str, prefix: bytes):
        """(key, value) pairs whose key starts with ``prefix``, in key order. Raises
        DataLoss if a damaged block interrupts them (rocksdict's own iteration would
        just stop there)."""
        it = self.cf[cf].iter()
        last = None
        try:
            it.seek(prefix)
            while it.valid():
                key = it.key()
                if not key.startswith(prefix):
                    return
                yield key, it.value()
                last = key
                it.next()
            it.status()
        except Exception as e:
            after = f"after key {last.hex()}" if last is not None else f"at prefix {prefix.hex()}"
            if _is_corruption(e):
                raise DataLoss(f"SSD tier ({cf}): a damaged block {after}: {e}") from None
            raise _translate(e, f"reading the SSD tier ({cf}) {after}") from None
        finally:
            del it  # a traceback kept by a caller must not keep the database open

    def keys_unverified(self, cf: str, prefix: bytes) -> list[bytes]:
        """The keys starting with ``prefix``, read with block checksums off, so that the
        keys of a block whose checksum fails are still listed (those a flip garbled may
        be listed garbled). Only for finding what to read; values are read checked."""
        options = ReadOptions()
        options.set_verify_checksums(False)
        options.fill_cache(False)  # an unverified block must not be served to checked reads later
        it = self.cf[cf].iter(options)
        out = []
        try:
            it.seek(prefix)
            while it.valid() and it.key().startswith(prefix):
                out.append(it.key())
                it.next()
            it.status()
        except Exception as e:
            raise (DataLoss(f"SSD tier ({cf}): cannot list keys at {prefix!r}: {e}") if _is_corruption(e) else
                   _translate(e, f"reading the SSD tier ({cf})")) from None
        finally:
            del it
        return out

    def last_key(self, cf: str, prefix: bytes) -> bytes | None:
        """The greatest key starting with ``prefix`` (one seek), or None."""
        it = self.cf[cf].iter()
        try:
            it.seek_for_prev(prefix + b"\xff" * 16)
            key = it.key() if it.valid() else None
            it.status()
        except Exception as e:
            raise (DataLoss(f"SSD tier ({cf}): {e}") if _is_corruption(e) else
                   _translate(e, f"reading the SSD tier ({cf})")) from None
        finally:
            del it
        return key if key is not None and key.startswith(prefix) else None

    def flush(self) -> None:
        """Write every column family's memtable to SST files and wait. rocksdict lets go
        of the GIL meanwhile: other threads run on (measured: worst gap 15 ms while a
        38 MB memtable flushed for 330 ms)."""
        try:
            for cf in self.cf.values():
                cf.flush(True)
            self._db.flush(True)  # the default column family
        except Exception as e:
            raise _translate(e, "flushing the SSD tier") from None

    def checkpoint(self, path: str | Path) -> None:
        """A consistent copy of the database at ``path``, a directory that must not exist
        yet (hard links to the SST files). RocksDB flushes the memtables first, and
        rocksdict's ``create_checkpoint`` holds the GIL throughout (every other thread
        stopped 390 ms for a 38 MB memtable), so ``flush`` runs first: the flush inside
        then finds next to nothing (measured: 3-40 ms in all)."""
        self.flush()
        try:
            Checkpoint(self._db).create_checkpoint(str(path))
        except Exception as e:
            raise _translate(e, f"taking a checkpoint of the SSD tier into {path}") from None

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def unflushed_bytes(self) -> int:
        """Bytes in the memtables: what their flush writes to disk before the log goes."""
        return sum(cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0 for cf in self.cf.values())

    def check_free_space(self, nbytes: int = 0) -> None:
        """RESOURCE_EXHAUSTED unless a write of ``nbytes`` leaves RocksDB room to flush and
        ``min_free_bytes`` free: it costs its bytes twice (the log, then an SST file), and
        the memtables not yet flushed need theirs. A full disk stops RocksDB whole."""
        free, unflushed = self.free_bytes(), self.unflushed_bytes()
        if free - unflushed - 2 * nbytes < self.min_free_bytes:
            raise ResourceExhausted(f"the disk of data dir {self.path} is full: {free} bytes free, of which "
                                    f"RocksDB's next flush needs {unflushed} and this write {2 * nbytes}, and "
                                    f"min_free_disk_bytes={self.min_free_bytes} stay free; free space, "
                                    f"lower ssd_bytes (demote to the remote tier) or drop tables; "
                                    f"nothing was applied")

    def reclaim(self, begin: bytes, end: bytes) -> None:
        """Give back the disk space of keys just deleted in [begin, end) of the chunks and
        journal column families (a table's payload and log; its few keys in meta wait for
        RocksDB's own compactions): flush the memtables, so that the log files holding the
        deleted data can go, then compact the range, dropping the deleted data's SST files.
        Reads the range once (about 1.6 s per GiB here); other writes go on meanwhile, and
        so do other threads (rocksdict lets go of the GIL: worst gap 33 ms while 264 MiB
        were reclaimed in 0.98 s, 9 ms idle, on a loaded machine). A compaction that meets
        a damaged block stops RocksDB's writes, so a table known to be damaged is not
        reclaimed this way."""
        options = CompactOptions()
        options.set_exclusive_manual_compaction(False)
        with self._compacting:
            self.flush()
            try:
                for name in ("chunks", "journal"):
                    self.cf[name].compact_range(begin, end, options)
            except Exception as e:
                raise _translate(e, "compacting the SSD tier") from None

    def close(self) -> None:
        """Close the database. RocksDB lets go of its own lock only once every column
        family object is gone, so they are dropped first."""
        with self._compacting:
            self._close()

    def _close(self) -> None:
        for cf in self.cf.values():
            cf.close()
        self.cf.clear()
        self.handle.clear()
        self._db.close()
        del self._db
        gc.collect()
        self._lock_file.close()


def _lock(path: Path):
    f = open(path / "LOCK.expstore", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise FailedPrecondition(f"data dir {path} is in use by {holder}; stop it or use "
                                 f"another --data-dir") from None
    f.truncate(0)
    f.write(f"expstore-server pid {os.getpid()}\n")
    f.flush()
    return f


class DamagedValues(DataLoss):
    """Some keys of a multi-get sit in blocks that failed RocksDB's checksum: ``damaged``
    maps each to RocksDB's message (file and offset); ``values`` has the other keys'
    values (None for the damaged ones), so a caller can use what is intact."""

    def __init__(self, cf: str, values: list[bytes | None], damaged: dict[bytes, str]) -> None:
        first = next(iter(damaged.values()))
        super().__init__(f"SSD tier ({cf}): {len(damaged)} of {len(values)} values in damaged blocks: {first}")
        self.values, self.damaged = values, damaged


def _is_corruption(e: Exception) -> bool:
    return "Corruption:" in str(e)


def _translate(e: Exception, doing: str) -> Exception:
    text = str(e)
    if "No space left" in text or "ENOSPC" in text or "File too large" in text:
        return ResourceExhausted(f"{doing}: the disk is full ({text}); free space or move "
                                 f"the data dir; nothing was applied")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return ResourceExhausted(f"{doing}: the disk is full; nothing was applied")
    return Unavailable(f"{doing}: {text}")


def _parse_meta(meta: bytes) -> tuple[np.ndarray, int, int, pa.Schema]:
    """A chunk's meta value: (block row offsets, stored bytes, Arrow bytes, schema)."""
    n = int.from_bytes(meta[:4], "little")
    end = 4 + 8 * n
    return (np.frombuffer(meta, dtype=np.int64, count=n, offset=4), int.from_bytes(meta[end:end + 8], "little"),
            int.from_bytes(meta[end + 8:end + 16], "little"), pa.ipc.read_schema(pa.py_buffer(meta[end + 16:])))


def table_prefix(table_id: int) -> bytes:
    return table_id.to_bytes(4, "big")


def open_rocks_tier(path: str | Path, table: str, table_id: int = 1) -> "RocksTier":
    """A RocksTier on a database of its own, holding what it held before (tests and
    tools; a server's tables share one Database). ``close`` closes the database."""
    tier = RocksTier(Database(path), table_id, owns_db=True)
    tier.load(tier.stored_chunks())
    return tier


class RocksTier:
    """One table's chunks in the ``chunks`` column family.

    ``nbytes`` and ``size_of`` count Arrow bytes, like every tier; ``stored_nbytes`` and
    ``stored_size_of`` count the compressed bytes on disk (the SSD watermark's measure).
    Block offsets of chunks are cached after the first read of their meta key. Not thread-safe for writes of one chunk id; the
    table serialises them.
    """

    name = "ssd"

    def __init__(self, db: Database, table_id: int, budget: int = 1 << 62, *, owns_db: bool = False) -> None:
        self.db = db
        self._owns_db = owns_db
        self._prefix = table_prefix(table_id)
        self._budget = budget
        self._offsets: dict[int, np.ndarray] = {}  # chunk -> row offsets of its blocks
        self._schema: dict[int, pa.Schema] = {}     # chunk -> its schema (shared objects)
        self._schemas: dict[bytes, pa.Schema] = {}  # serialized -> decoded, once per table
        self._stored: dict[int, int] = {}  # chunk -> compressed bytes
        self._arrow: dict[int, int] = {}   # chunk -> Arrow bytes
        self._nbytes = self.stored_nbytes = 0
        self.table_id = table_id

    # -- the Tier protocol --------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def budget(self) -> int:
        return self._budget

    def __len__(self) -> int:
        return len(self._stored)

    def __contains__(self, chunk_id: int) -> bool:
        return chunk_id in self._stored

    def size_of(self, chunk_id: int) -> int:
        return self._arrow[chunk_id]

    def stored_size_of(self, chunk_id: int) -> int:
        return self._stored[chunk_id]

    def oldest(self) -> list[int]:
        """Chunk ids, oldest first (demotion order)."""
        return list(self._stored)

    def put(self, chunk_id: int, batch: pa.RecordBatch, durability: str = "wal") -> None:
        wb, offsets, size = self.encode(chunk_id, batch)
        self.db.write(wb, durability)
        self.commit_put(chunk_id, offsets, size, batch.get_total_buffer_size(), batch.schema)

    def encode(self, chunk_id: int, batch: pa.RecordBatch) -> tuple[WriteBatch, np.ndarray, int]:
        """The write batch storing a chunk, for callers that write it with other keys."""
        n = batch.num_rows
        per_row = max(1, batch.get_total_buffer_size() // max(1, n))
        step = max(1, BLOCK_BYTES // per_row)
        offsets = np.append(np.arange(0, n, step), n).astype(np.int64)
        wb = WriteBatch(raw_mode=True)
        size = 0
        h = self.db.handle["chunks"]
        for b, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
            value = codec.encode_block(batch.slice(lo, hi - lo))
            wb.put(self._key(chunk_id, b), value, h)
            size += len(value)
        arrow_bytes = batch.get_total_buffer_size()
        meta = len(offsets).to_bytes(4, "little") + offsets.tobytes() + size.to_bytes(8, "little") + \
            arrow_bytes.to_bytes(8, "little") + batch.schema.serialize().to_pybytes()
        wb.put(self._key(chunk_id, _META_BLOCK), meta, h)
        return wb, offsets, size


    def commit_put(self, chunk_id: int, offsets: np.ndarray, stored: int, arrow: int,
                   schema: pa.Schema) -> None:
        if chunk_id in self._stored:  # a put of a held id replaces it
            self._forget(chunk_id)
        self._schema[chunk_id] = self._schemas.setdefault(schema.serialize().to_pybytes(), schema)
        self._offsets[chunk_id] = offsets
        self._stored[chunk_id], self._arrow[chunk_id] = stored, arrow
        self.stored_nbytes += stored
        self._nbytes += arrow

    def _forget(self, chunk_id: int) -> None:
        self._offsets.pop(chunk_id, None)
        self._schema.pop(chunk_id, None)
        self.stored_nbytes -= self._stored.pop(chunk_id, 0)
        self._nbytes -= self._arrow.pop(chunk_id, 0)

    def get(self, chunk_ids: Iterable[int]) -> dict[int, pa.RecordBatch]:
        chunk_ids = list(dict.fromkeys(chunk_ids))
        self._load_offsets(chunk_ids)
        keys, owners = [], []
        for c in chunk_ids:
            nblocks = len(self._offsets[c]) - 1
            keys += [self._key(c, b) for b in range(nblocks)]
            owners += [c] * nblocks
        blocks = self._read(keys, owners)
        out: dict[int, list] = {c: [] for c in chunk_ids}
        for c, batch in zip(owners, blocks):
            out[c].append(batch)
        return {c: parts[0] if len(parts) == 1 else pa.concat_batches(parts) for c, parts in out.items()}

    def get_rows(self, chunks: np.ndarray, rows: np.ndarray) -> tuple[dict[int, pa.RecordBatch], np.ndarray, np.ndarray]:
        """The blocks holding rows ``rows[i]`` of ``chunks[i]``, read in one multi-get:
        (blocks by key, key per row, row within its block), ready for ``take_rows``."""
        unique = np.unique(chunks).tolist()
        self._load_offsets(unique)
        block = np.empty(len(rows), dtype=np.int64)
        local = np.empty(len(rows), dtype=np.int64)
        for c in unique:
            at = chunks == c
            offsets = self._offsets[c]
            b = np.searchsorted(offsets, rows[at], side="right") - 1
            block[at], local[at] = b, rows[at] - offsets[b]
        keys = chunks.astype(np.int64) * (1 << 20) + block  # < 2**20 blocks per chunk
        wanted = np.unique(keys).tolist()
        batches = self._read([self._key(k >> 20, k & 0xFFFFF) for k in wanted], [k >> 20 for k in wanted])
        return dict(zip(wanted, batches)), keys, local

    def delete(self, chunk_ids: Iterable[int]) -> None:
        wb = WriteBatch(raw_mode=True)
        h = self.db.handle["chunks"]
        gone = []
        for c in chunk_ids:
            wb.delete_range(self._key(c, 0), self._key(c + 1, 0), h)
            gone.append(c)
        if not gone:
            return
        self.db.write(wb, "wal")
        for c in gone:
            self._forget(c)

    def delete_all(self) -> None:
        """Delete every key of this table's chunks (a dropped table's), without reading them."""
        wb = WriteBatch(raw_mode=True)
        wb.delete_range(self._prefix, table_prefix(self.table_id + 1), self.db.handle["chunks"])
        self.db.write(wb, "wal")
        for c in list(self._stored):
            self._forget(c)

    def close(self) -> None:
        if self._owns_db:
            self.db.close()

    # -- recovery -----------------------------------------------------------------------

    def load(self, chunk_ids: Iterable[int], damaged: dict[int, str] | None = None) -> list[int]:
        """Adopt chunks written before a restart; returns the ids that are missing. A
        chunk whose metadata is damaged is unreadable whole: it goes into ``damaged``
        (id -> why) when given; otherwise DataLoss names it, after the others are loaded."""
        chunk_ids = list(chunk_ids)
        keys = [self._key(c, _META_BLOCK) for c in chunk_ids]
        try:
            metas, bad = self.db.get("chunks", keys), {}
        except DamagedValues as e:
            metas, bad = e.values, e.damaged
        missing, found = [], {}
        for c, key, meta in zip(chunk_ids, keys, metas):
            if key in bad:
                found[c] = f"SSD tier, table id {self.table_id}, chunk {c}, metadata: {bad[key]}"
            elif meta is None:
                missing.append(c)
            elif c not in self._stored:
                self.commit_put(c, *_parse_meta(meta))
        if found and damaged is None:
            raise DataLoss(next(iter(found.values())), damage=dict.fromkeys(found))
        if found:
            damaged.update(found)
        return missing

    def last_chunk_id(self) -> int | None:
        """The greatest chunk id with any key (one seek), or None."""
        key = self.db.last_key("chunks", self._prefix)
        return None if key is None else int.from_bytes(key[4:12], "big")

    def stored_chunks(self) -> list[int]:
        """Every chunk id with a meta key (orphans included), for garbage collection."""
        return [int.from_bytes(k[4:12], "big") for k, _ in self.db.items("chunks", self._prefix)
                if k[12:] == _META_BLOCK.to_bytes(4, "big")]

    # -- internals ----------------------------------------------------------------------

    def _key(self, chunk_id: int, block: int) -> bytes:
        return self._prefix + chunk_id.to_bytes(8, "big") + block.to_bytes(4, "big")

    def _load_offsets(self, chunk_ids: list[int]) -> None:
        unknown = [c for c in chunk_ids if c not in self._offsets]
        missing = self.load(unknown) if unknown else []
        if missing:
            raise NotFound(f"chunk {missing[0]} is not in the SSD tier")

    def _read(self, keys: list[bytes], owners: list[int]) -> list[pa.RecordBatch]:
        """Decode the blocks of ``keys`` (of chunks ``owners``). Every damaged block is
        checked, not only the first: the DataLoss names one and its ``damage`` has the
        row ranges of all of them."""
        try:
            values, bad = self.db.get("chunks", keys), {}
        except DamagedValues as e:
            values, bad = e.values, e.damaged
        out, damage, first = [], {}, None
        for key, chunk, value in zip(keys, owners, values):
            block = int.from_bytes(key[12:], "big")
            what = f"SSD tier, table id {self.table_id}, chunk {chunk}, block {block}"
            try:
                if key in bad:
                    raise DataLoss(f"{what}: {bad[key]}")
                if value is None:
                    raise NotFound(f"{what} is missing")
                out.append(codec.decode_block(value, self._schema[chunk], what))
            except DataLoss as e:
                offsets = self._offsets[chunk]
                damage.setdefault(chunk, []).append((int(offsets[block]), int(offsets[block + 1])))
                first = first or str(e)
        if damage:
            more = sum(map(len, damage.values())) - 1
            raise DataLoss(first + (f" (and {more} more damaged blocks)" if more else ""), damage=damage)
        return out
