"""SSD tier: RocksDB (rocksdict) in the server's data dir.

One database per server, shared by its tables, in column families::

    chunks.<table id>  table id (4) | chunk id (8) | block (4)  -> rows [lo, hi) of the chunk (a codec block)
                       table id (4) | chunk id (8) | 0xFFFFFFFF -> block offsets and checksums, sizes, schema
    journal            table id (4) | sequence (8)              -> the table's state changes (journal.py)
    meta               b"table/" name, b"snapshot/" table id, ... -> table records and snapshots
    chunks             the same keys as chunks.<table id>: chunks written before tables had
                       families of their own (read, deleted, never written)
    chunk_files        empty: the data dir may hold chunk files. A server from before them
                       would misread their meta values; RocksDB makes it refuse the data
                       dir instead, naming this family, which it does not open

and, in ``BLOCKS_DIR`` of the RocksDB directory, ``<table id>/<chunk id>.blocks``: the
blocks of each chunk of at least FILE_BYTES, in a file of its own (files.py), whose meta
value records where each block is; RocksDB then holds no block of it.

Each table's chunks have a column family of their own, so its blob files hold its values
only: DropTable drops the family and RocksDB deletes its files at once, however large,
instead of compacting them away (a blob file shared with another table would stay until
that table's blobs in it were moved out).

A chunk is stored as blocks of whole rows, as near BLOCK_BYTES as whole rows allow
(``block_offsets``; one row when rows are larger than 1.5 BLOCK_BYTES): sampling one cold
row reads its block (a RocksDB multi-get for a whole batch of rows), not the whole 8 MiB
chunk. The block size trades the two paths: each block costs the insert a fixed ~50 us to
encode as IPC (nested columns; ~140 us with its put and CRC) and a random read of one row
costs its block's bytes (blob read, LZ4, copy: ~750 MB/s here). Measured on 256 rows of
36 KiB: one-row blocks 36 ms to encode, 13 ms to read 256 random rows; two-row blocks
(72 KiB) 18 ms and 23 ms; 8-row blocks 7 ms and 65 ms. A chunk stored with shared prompt
prefixes (prefixes.py) keeps them in each block that uses them (``prefixes.compact``): a
block is read on its own. Blocks are Arrow IPC messages as they are (``codec``). A chunk
of at least FILE_BYTES (256 rows of 4 KiB) goes to a file of its own (files.py says why:
RocksDB's log write costs ~8x a file write here, with the GIL held); in a smaller one,
values of at least MIN_BLOB_BYTES go to RocksDB's blob files, which keep them out of
compactions and compress them (LZ4) when a memtable is flushed, in RocksDB's background
threads, so an insert pays only the write-ahead log and the memtable. From a chunk file
a block is one read from the page cache: sample(256) of a table on the SSD tier alone
took ~10 ms (p50, in process) where blob files took ~25 ms. The block size holds for
chunk files too: 128 KiB blocks made their inserts 9.2 ms instead of 10.8 and those
samples 15.5 ms instead of 12. LZ4, not zstd: measured here on
realistic tokens, zstd (level 3 in blob files) stored 0.67 of the Arrow bytes for ~40 ms
of background CPU per 9.4 MB insert, LZ4 0.78 for ~10 ms; on a machine with few cores
that CPU is taken from the inserts and samples.

Writes take a durability level: ``memory`` skips the write-ahead log (lost on a crash
until RocksDB flushes), ``wal`` appends to the log (survives a killed process), ``fsync``
also syncs the log: ``Database.sync`` makes every write before it durable, and concurrent
callers share one fsync (group commit: one of them syncs for all who are waiting).

Cost of a RocksDB write, measured here (one chunk of 256 x 36 KiB rows, 9.7 MB): 15-20 ms
at ``wal``, of which ~3 ms without the log (the memtable): rocksdict 0.3.29's RocksDB
computes the log records' CRC32C in software (perf: table-driven ``crc32c::Extend``, 33%
of a write benchmark's CPU; the flush computes it again for the blob file), where a
``writev`` of the same bytes into a file takes ~2 ms: so such chunks go to files. rocksdict
holds the GIL throughout a write, so no other Python thread runs meanwhile: encoding the
next chunk on a second thread while one is written made inserts slower (35 -> 42 ms and
29 -> 70 ms a chunk, 2 cores), and commits are not pipelined for that reason.

Space: a chunk file is deleted with its chunk (after its keys). A blob file (one memtable
flush of one table's chunks) is deleted once every chunk in it is deleted (and a
compaction has dropped their keys): the oldest chunks leave first under the default
remover, so whole files go; a chunk kept among dead ones keeps its file (there is no blob
garbage collection, which rewrote live blobs at every compaction).

Flushes and compactions write their files with direct I/O (O_DIRECT) where the data
dir's filesystem allows it (``direct_writes``): a durable insert's bytes are written
twice, to the log now and to a blob file at the flush, and buffered, each write copies
them into fresh page-cache pages. Measured here, 36 KiB rows inserted over gRPC back to
back (9.4 MB an insert, 40 inserts, two sets of three alternating runs): with direct
flushes 35-52 ms an insert and 40-58 ms of server CPU in five runs (92 and 96 ms in the
sixth), buffered 64-81 ms and 88-110 ms, where 44% of the server's CPU was the kernel's
copy into the page cache. The blob files are then not in the page cache when they are
first read: a sample of 256 random rows from the SSD tier alone took 23 ms against 18 ms
(p50, one run); the rows read most are the newest, which the table's memory tier holds.

Memory: RocksDB's own is bounded by ``memtable_bytes`` (the write buffers of all column
families together; the chunks family has three, so one flushes while inserts fill the
next) and ``cache_bytes`` (one LRU block cache shared by every column family: index,
small values and SST blocks; blob values are read through the OS page cache).

Damage: RocksDB checksums every SST block and every blob record it stores and verifies
them on read. A read that meets a damaged one raises DataLoss (``DamagedValues`` names
the keys of a multi-get that are damaged, the others are still read), and an iteration
that meets one raises DataLoss instead of ending early, so a reader never mistakes a
damaged range for its end.

Disk space: RocksDB stops taking writes for good (until reopened) once a write or a flush
meets a full disk, so writes that store data (``write(..., grows=n)``, ``growing``: a chunk
file and its meta key) are refused first,
while the disk still has room for them twice (the log now, a blob or SST file at the
flush) and for the flush of every memtable, plus ``min_free_bytes``. Deletes are never
refused, and ``reclaim`` gives their space back at once: a dropped table's keys would
otherwise hold their log files, SST files and blob files until later compactions.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np
import pyarrow as pa
from rocksdict import (BlockBasedOptions, Cache, Checkpoint, CompactOptions, DBCompressionType, Options, Rdict,
                       ReadOptions, WriteBatch, WriteOptions)

from .. import codec, prefixes
from ..errors import DataLoss, FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from .base import UNBOUNDED
from .files import ChunkFiles, Spares, link_all, make_directory

_Blocks = TypeVar("_Blocks", bound=codec.Blocks)

COLUMN_FAMILIES = ("chunks", "journal", "meta", "chunk_files")
CHUNK_FAMILY = "chunks."  # + table id: a table's chunks
DURABILITIES = ("memory", "wal", "fsync")
BLOCK_BYTES = 64 << 10
# Chunk meta values with block checksums start with a magic naming the checksum (the
# legacy ones, whose blocks carry their own, start with a count): EXM3 CRC32C, EXM2 CRC32.
META_MAGICS = {"crc32c": b"EXM3", "crc32": b"EXM2"}
FILE_META_MAGIC = b"EXF3"  # CRC32C, and the blocks are in the chunk's file (files.py)
FILE_BYTES = 1 << 20  # chunks of at least this many Arrow bytes are stored in a file of their own
BLOCKS_DIR = "blocks"  # in the RocksDB directory: the chunk files, a directory per table id
MIN_BLOB_BYTES = 4096  # chunk values at least this large live in blob files
MEMTABLE_BYTES = 256 << 20  # default budget of all write buffers together
CACHE_BYTES = 64 << 20  # default size of the block cache
_META_BLOCK = 0xFFFFFFFF
LOCK_FILE = "LOCK.expstore"  # in the data dir: held by the process that has it open
# Each column family's share of the memtable budget: (buffers, fraction of the budget each).
_WRITE_BUFFERS = {CHUNK_FAMILY: (3, 1 / 4), "chunks": (2, 1 / 32), "journal": (2, 1 / 16), "meta": (2, 1 / 32),
                  "default": (2, 1 / 32), "chunk_files": (2, 0)}  # never written: the 1 MiB floor


def _options(cf: str, memtable_bytes: int, cache: Cache, direct_writes: bool) -> Options:
    """The options of one column family (``default``: also the database's own; a table's
    chunks: CHUNK_FAMILY)."""
    o = Options(raw_mode=True)
    o.create_if_missing(True)
    o.create_missing_column_families(True)
    o.set_use_direct_io_for_flush_and_compaction(direct_writes)
    o.set_db_write_buffer_size(memtable_bytes)
    o.set_max_background_jobs(2)
    buffers, share = _WRITE_BUFFERS[cf]
    o.set_max_write_buffer_number(buffers)
    o.set_write_buffer_size(max(1 << 20, int(memtable_bytes * share)))
    table = BlockBasedOptions()
    table.set_block_cache(cache)
    o.set_block_based_table_factory(table)
    o.set_compression_type(DBCompressionType.none())  # SSTs hold small values: journal, meta, blob indexes
    if cf in ("chunks", CHUNK_FAMILY):
        o.set_enable_blob_files(True)
        o.set_min_blob_size(MIN_BLOB_BYTES)
        o.set_blob_compression_type(DBCompressionType.lz4())
        # No blob garbage collection: it rewrote the live blobs of the oldest files at every
        # compaction that met them (1,900 MB of inserts: 437 items/s with it, 1,117 without).
        # A blob file holds one flush of one table's chunks, and goes once all are deleted.
        o.set_enable_blob_gc(False)
    return o


class Database:
    """The data dir's RocksDB, opened once per process under an exclusive lock."""

    def __init__(self, path: str | Path, min_free_bytes: int = 0, *, memtable_bytes: int = MEMTABLE_BYTES,
                 cache_bytes: int = CACHE_BYTES, direct_writes: bool = True) -> None:
        self.path = Path(path)
        self.min_free_bytes = min_free_bytes
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock(self.path)
        # Asked for and possible here: flushes and compactions write with O_DIRECT.
        self.direct_writes = direct_writes and _takes_direct_io(self.path / LOCK_FILE)
        self._memtable_bytes, self._cache = memtable_bytes, Cache(cache_bytes)  # an LRU cache
        rocks = self.path / "rocksdb"
        try:
            existing = Rdict.list_cf(str(rocks)) if (rocks / "CURRENT").exists() else []
            families = [*COLUMN_FAMILIES, *(cf for cf in existing if cf.startswith(CHUNK_FAMILY))]
            self._db = Rdict(str(rocks), self._options("default"),
                             column_families={cf: self._options(cf) for cf in families})
        except Exception as e:
            self._lock_file.close()
            raise _translate(e, f"opening {self.path}") from None
        self.cf = {cf: self._db.get_column_family(cf) for cf in families}
        self.blocks = rocks / BLOCKS_DIR
        make_directory(self.blocks)
        self._spares = Spares(self.blocks)  # deleted chunk files, written over by new ones
        self.handle = {cf: self._db.get_column_family_handle(cf) for cf in families}
        self._families = threading.Lock()  # creating and dropping column families
        self._write_options = {}
        for level in DURABILITIES:
            w = WriteOptions()
            w.disable_wal = level == "memory"
            self._write_options[level] = w
        self._space = threading.Lock()  # one growing write at a time between check and write
        self._removing = threading.Lock()  # chunk files are deleted, or linked into a checkpoint
        self._compacting = threading.Lock()  # close waits for a reclaim in progress
        self._group_commit = threading.Condition()
        self._sync_tickets = 0  # sync calls so far
        self._synced = 0  # every call up to this ticket is synced
        self._syncing = False  # a caller is running the fsync for everyone waiting
        self.syncs = 0  # fsyncs run (group commit: fewer than the sync calls)

    def _options(self, cf: str) -> Options:
        return _options(CHUNK_FAMILY if cf.startswith(CHUNK_FAMILY) else cf, self._memtable_bytes, self._cache,
                        self.direct_writes)

    def family(self, name: str) -> str:
        """Create column family ``name`` (a table's chunks) unless it exists; returns it."""
        with self._families:
            if name not in self.cf:
                try:
                    self.cf[name] = self._db.create_column_family(name, self._options(name))
                except Exception as e:
                    raise _translate(e, f"creating column family {name}") from None
                self.handle[name] = self._db.get_column_family_handle(name)
        return name

    def drop_family(self, name: str) -> None:
        """Drop column family ``name`` and every key in it: RocksDB deletes its files (log,
        SST and blob) once no reader uses them, without reading them."""
        with self._families:
            cf = self.cf.pop(name, None)
            self.handle.pop(name, None)
            if cf is None:
                return
            cf.close()
            del cf
            try:
                self._db.drop_column_family(name)
            except Exception as e:
                raise _translate(e, f"dropping column family {name}") from None
            gc.collect()  # RocksDB deletes the files once the last handle object is gone

    def chunk_files(self, table_id: int) -> ChunkFiles:
        """The files of table ``table_id``'s large chunks (files.py)."""
        return ChunkFiles(self.blocks / str(table_id), self._removing, self._spares)

    def write(self, batch: WriteBatch, durability: str = "wal", *, grows: int = 0) -> None:
        """Apply ``batch`` at ``durability``. A batch that stores data passes the ``grows``
        bytes it adds: it is refused (RESOURCE_EXHAUSTED, nothing written) unless the
        disk has room for it (``check_free_space``)."""
        if not grows:
            self._write(batch, durability)
            return
        with self.growing(grows):
            self._write(batch, durability)

    @contextlib.contextmanager
    def growing(self, nbytes: int) -> Iterator[None]:
        """Hold the room for writes of ``nbytes`` made inside: RESOURCE_EXHAUSTED (before
        anything is written) unless the disk has it; growing writes go one at a time."""
        with self._space:
            self.check_free_space(nbytes)
            yield

    def _write(self, batch: WriteBatch, durability: str) -> None:
        try:
            self._db.write(batch, self._write_options[durability])
        except Exception as e:
            raise _translate(e, "writing to the SSD tier") from None

    def sync(self) -> None:
        """fsync the write-ahead log: every write made before this call is on disk.
        Concurrent callers share fsyncs (group commit): a caller finding none running
        runs one for every ticket taken so far; the others wait for it, and one whose
        ticket came after its start runs the next. An fsync that fails fails every
        caller it was run for (each may retry)."""
        with self._group_commit:
            self._sync_tickets += 1
            ticket = self._sync_tickets
            while self._synced < ticket:
                if self._syncing:
                    self._group_commit.wait()
                    continue
                self._syncing, upto = True, self._sync_tickets
                error = None
                self._group_commit.release()
                try:
                    self._db.flush_wal(True)
                except Exception as e:  # noqa: BLE001 - reported to this caller; the others retry
                    error = _translate(e, "syncing the SSD tier's log")
                finally:
                    self._group_commit.acquire()
                    self._syncing = False
                    self.syncs += 1
                    if error is None:
                        self._synced = max(self._synced, upto)
                    self._group_commit.notify_all()
                if error is not None:
                    raise error

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
            for cf in list(self.cf.values()):
                cf.flush(True)
            self._db.flush(True)  # the default column family
        except Exception as e:
            raise _translate(e, "flushing the SSD tier") from None

    def checkpoint(self, path: str | Path) -> None:
        """A consistent copy of the database at ``path``, a directory that must not exist
        yet (hard links to the SST files, and to the chunk files in ``BLOCKS_DIR``, which
        no delete removes meanwhile). RocksDB flushes the memtables first, and rocksdict's
        ``create_checkpoint`` holds the GIL throughout (every other thread stopped 390 ms
        for a 38 MB memtable), so ``flush`` runs first: the flush inside then finds next
        to nothing (measured: 3-40 ms in all)."""
        self.flush()
        with self._removing:  # every chunk file a meta key in the checkpoint names is linked
            try:
                Checkpoint(self._db).create_checkpoint(str(path))
                link_all(self.blocks, Path(path) / BLOCKS_DIR)
            except Exception as e:
                raise _translate(e, f"taking a checkpoint of the SSD tier into {path}") from None

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def unflushed_bytes(self) -> int:
        """Bytes in the memtables: what their flush writes to disk before the log goes."""
        return sum(cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0 for cf in list(self.cf.values()))

    def check_free_space(self, nbytes: int = 0) -> None:
        """RESOURCE_EXHAUSTED unless a write of ``nbytes`` leaves RocksDB room to flush and
        ``min_free_bytes`` free: it costs its bytes twice (the log, then an SST file), and
        the memtables not yet flushed need theirs. A full disk stops RocksDB whole. Spare
        chunk files (files.Spares) are the first space given back."""
        free, unflushed = self.free_bytes(), self.unflushed_bytes()
        if free - unflushed - 2 * nbytes < self.min_free_bytes and self._spares.release():
            free = self.free_bytes()
        if free - unflushed - 2 * nbytes < self.min_free_bytes:
            raise ResourceExhausted(f"the disk of data dir {self.path} is full: {free} bytes free, of which "
                                    f"RocksDB's next flush needs {unflushed} and this write {2 * nbytes}, and "
                                    f"min_free_disk_bytes={self.min_free_bytes} stay free; free space, "
                                    f"lower ssd_bytes (demote to the remote tier) or drop tables; "
                                    f"nothing was applied")

    def reclaim(self, begin: bytes, end: bytes) -> None:
        """Give back the disk space of keys just deleted in [begin, end) of the journal and
        the legacy chunks column families (a table's log and its chunks written before it
        had a family of its own, ``drop_family``; its few keys in meta wait for RocksDB's
        own compactions): flush the memtables, so that the log files holding the deleted
        data can go, then compact the range, dropping the deleted data's files.
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
        self._spares.release()
        for cf in self.cf.values():
            cf.close()
        self.cf.clear()
        self.handle.clear()
        self._db.close()
        del self._db
        gc.collect()
        self._lock_file.close()


def _lock(path: Path):
    f = open(path / LOCK_FILE, "a+")
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


def _takes_direct_io(path: Path) -> bool:
    """Whether the filesystem holding ``path`` (an existing file) opens files for direct
    I/O (O_DIRECT; not every filesystem does, and not off Linux): RocksDB fails every flush
    on one that does not, so it is asked only where it works."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        os.close(os.open(path, os.O_RDONLY | flag))
    except OSError:
        return False
    return True


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


@dataclass(frozen=True)
class Layout:
    """How a chunk is stored: the row offsets of its blocks, each block's checksum (None
    for blocks of the legacy format, which carry their own) and what computed them (a key
    of ``codec.CHECKSUMS``), stored and Arrow bytes, schema, and where its blocks are:
    RocksDB values, or (``positions``: each block's byte bounds) the chunk's file."""

    offsets: np.ndarray
    checksums: np.ndarray | None
    stored: int
    arrow: int
    schema: pa.Schema
    algorithm: str = codec.BLOCK_CHECKSUM
    positions: np.ndarray | None = None

    @property
    def in_file(self) -> bool:
        return self.positions is not None

    def encode(self) -> bytes:
        """The chunk's meta value: ``magic (META_MAGICS[algorithm], or FILE_META_MAGIC) |
        blocks + 1 (4) | row offsets (8 each) | checksum of each block (4 each) | [byte
        position of each block in the file, and its end (8 each)] | stored bytes (8) |
        Arrow bytes (8) | schema``."""
        magic = FILE_META_MAGIC if self.in_file else META_MAGICS[self.algorithm]
        return magic + len(self.offsets).to_bytes(4, "little") + self.offsets.astype("<i8").tobytes() + \
            self.checksums.astype("<u4").tobytes() + \
            (self.positions.astype("<i8").tobytes() if self.in_file else b"") + \
            self.stored.to_bytes(8, "little") + self.arrow.to_bytes(8, "little") + self.schema.serialize().to_pybytes()

    @classmethod
    def decode(cls, meta: bytes) -> "Layout":
        """Any format: ``encode``'s (any magic), or the legacy one (no magic, no
        checksums: its blocks carry theirs), which starts with the offsets' count."""
        at, n, checksums, positions = 0, int.from_bytes(meta[:4], "little"), None, None
        in_file = meta[:4] == FILE_META_MAGIC
        algorithm = "crc32c" if in_file else next((a for a, magic in META_MAGICS.items() if meta[:4] == magic), None)
        if algorithm is not None:
            at, n = 4, int.from_bytes(meta[4:8], "little")
        offsets = np.frombuffer(meta, dtype="<i8", count=n, offset=at + 4)
        end = at + 4 + 8 * n
        if at:
            checksums = np.frombuffer(meta, dtype="<u4", count=n - 1, offset=end)
            end += 4 * (n - 1)
        if in_file:
            positions = np.frombuffer(meta, dtype="<i8", count=n, offset=end)
            end += 8 * n
        return cls(offsets, checksums, int.from_bytes(meta[end:end + 8], "little"),
                   int.from_bytes(meta[end + 8:end + 16], "little"), pa.ipc.read_schema(pa.py_buffer(meta[end + 16:])),
                   algorithm or codec.BLOCK_CHECKSUM, positions)


def block_offsets(rows: int, arrow_bytes: int) -> np.ndarray:
    """The row offsets of a chunk's blocks (``rows`` + 1 bounds): blocks of the whole
    number of rows whose bytes come nearest BLOCK_BYTES (at least one row)."""
    row_bytes = max(1, arrow_bytes // max(1, rows))
    step = max(1, round(BLOCK_BYTES / row_bytes))
    return np.append(np.arange(0, rows, step), rows).astype(np.int64)


def _encode(batch: pa.RecordBatch, encode: Callable[[list[pa.RecordBatch]], _Blocks]) -> tuple[np.ndarray, _Blocks]:
    """A chunk's block offsets (``block_offsets``) and its blocks: ``encode`` makes them
    of the slices."""
    offsets = block_offsets(batch.num_rows, batch.get_total_buffer_size())
    slices = [batch.slice(lo, hi - lo) for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    if prefixes.is_shared(batch.schema):  # each block keeps only the prompts its rows use
        slices = list(map(prefixes.compact, slices))
    return offsets, encode(slices)


def _layout(batch: pa.RecordBatch, offsets: np.ndarray, blocks: _Blocks) -> Layout:
    """The layout of a chunk stored as ``blocks``, with each block's checksum
    (``codec.block_checksum``, read once the blocks are written: codec.Blocks), checked
    when the block is read: RocksDB checks its own on the stored bytes; this one covers the
    way from here to there, and is the only one of a chunk file."""
    return Layout(offsets, np.array(blocks.checksums, np.uint32), sum(blocks.sizes), batch.get_total_buffer_size(),
                  batch.schema, codec.BLOCK_CHECKSUM)


def table_prefix(table_id: int) -> bytes:
    return table_id.to_bytes(4, "big")


def open_rocks_tier(path: str | Path, table: str, table_id: int = 1) -> "RocksTier":
    """A RocksTier on a database of its own, holding what it held before (tests and
    tools; a server's tables share one Database). ``close`` closes the database."""
    tier = RocksTier(Database(path), table_id, owns_db=True)
    tier.load(tier.stored_chunks())
    return tier


class RocksTier:
    """One table's chunks, in its column family ``chunks.<table id>`` (and, read only,
    those an older version wrote to the shared ``chunks`` family).

    ``nbytes`` and ``size_of`` count Arrow bytes, like every tier; ``stored_nbytes`` and
    ``stored_size_of`` count the bytes written (IPC messages; legacy blocks: zstd), the
    SSD watermark's measure; RocksDB's LZ4 makes the files smaller. Each chunk's
    ``Layout`` (block offsets and checksums, sizes, schema) is kept from its put, or from
    the first read of its meta key after a restart; chunks of one schema share one schema
    object. Not thread-safe for writes of one chunk id; the table serialises them.
    """

    name = "ssd"

    def __init__(self, db: Database, table_id: int, *, owns_db: bool = False) -> None:
        self.db = db
        self._owns_db = owns_db
        self._prefix = table_prefix(table_id)
        self._layouts: dict[int, Layout] = {}  # chunk -> how it is stored, oldest first
        self._schemas: dict[bytes, pa.Schema] = {}  # serialized -> decoded, once per table
        self._nbytes = self.stored_nbytes = 0
        self.table_id = table_id
        self._cf = db.family(f"{CHUNK_FAMILY}{table_id}")
        self._files = db.chunk_files(table_id)  # the blocks of chunks of at least FILE_BYTES
        self._legacy: set[int] = set()  # chunks in the shared (legacy) family
        self._has_legacy = db.last_key("chunks", self._prefix) is not None  # one seek

    @property
    def family(self) -> str:
        """The column family this table's chunks are written to."""
        return self._cf

    # -- the Tier protocol --------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def budget(self) -> int:
        """Unbounded here: a table's ``ssd_bytes`` is a watermark its placement demotes
        above (``Placement.demotion_candidates``), not a limit on puts."""
        return UNBOUNDED

    def __len__(self) -> int:
        return len(self._layouts)

    def __contains__(self, chunk_id: int) -> bool:
        return chunk_id in self._layouts

    def size_of(self, chunk_id: int) -> int:
        return self._layouts[chunk_id].arrow

    def stored_size_of(self, chunk_id: int) -> int:
        return self._layouts[chunk_id].stored

    def oldest(self) -> list[int]:
        """Chunk ids, oldest first (demotion order)."""
        return list(self._layouts)

    def put(self, chunk_id: int, batch: pa.RecordBatch, durability: str = "wal") -> None:
        self.commit_put(chunk_id, self.write(chunk_id, batch, durability))

    def write(self, chunk_id: int, batch: pa.RecordBatch, durability: str = "wal") -> Layout:
        """Store a chunk at ``durability`` (not held yet: ``commit_put``); RESOURCE_EXHAUSTED,
        nothing stored, unless the disk has room for it. A chunk of at least FILE_BYTES
        goes to a file of its own (files.py), then its meta key to RocksDB; a smaller one
        is one RocksDB write (``encode``)."""
        if batch.get_total_buffer_size() < FILE_BYTES:
            wb, layout = self.encode(chunk_id, batch)
            self.db.write(wb, durability, grows=layout.stored)
            return layout
        offsets, blocks = _encode(batch, codec.encode_blocks)
        with self.db.growing(sum(blocks.sizes)):
            try:
                self._files.write(chunk_id, blocks, sync=durability == "fsync")
            except OSError as e:
                raise _translate(e, f"writing {self._files.path(chunk_id)}") from None
            try:
                positions = np.cumsum([0, *blocks.sizes], dtype=np.int64)
                layout = replace(_layout(batch, offsets, blocks), positions=positions)
                wb = WriteBatch(raw_mode=True)
                wb.put(self.block_key(chunk_id, _META_BLOCK), layout.encode(), self.db.handle[self._cf])
                self.db.write(wb, durability)
            except BaseException:
                self._files.delete([chunk_id])
                raise
        return layout

    def encode(self, chunk_id: int, batch: pa.RecordBatch) -> tuple[WriteBatch, Layout]:
        """The write batch storing a chunk in RocksDB alone: its blocks (IPC messages, one
        copy of the rows) and its meta value (``Layout``)."""
        offsets, blocks = _encode(batch, codec.SerializedBlocks.of)
        layout = _layout(batch, offsets, blocks)
        wb = WriteBatch(raw_mode=True)
        h = self.db.handle[self._cf]
        for b, value in enumerate(blocks.buffers):
            wb.put(self.block_key(chunk_id, b), value.to_pybytes(), h)
        wb.put(self.block_key(chunk_id, _META_BLOCK), layout.encode(), h)
        return wb, layout

    def commit_put(self, chunk_id: int, layout: Layout) -> None:
        """Hold a chunk whose keys are written (``encode``'s layout, or one read back)."""
        if chunk_id in self._layouts:  # a put of a held id replaces it
            self._forget(chunk_id)
        schema = self._schemas.setdefault(layout.schema.serialize().to_pybytes(), layout.schema)
        self._layouts[chunk_id] = layout if schema is layout.schema else replace(layout, schema=schema)
        self.stored_nbytes += layout.stored
        self._nbytes += layout.arrow

    def _forget(self, chunk_id: int) -> None:
        self._legacy.discard(chunk_id)
        layout = self._layouts.pop(chunk_id, None)
        if layout is not None:
            self.stored_nbytes -= layout.stored
            self._nbytes -= layout.arrow

    def layout(self, chunk_id: int) -> Layout:
        """How a stored chunk is stored (its meta key is read on first use)."""
        self._load_layouts([chunk_id])
        return self._layouts[chunk_id]

    def rows_of(self, chunk_id: int) -> int:
        """The rows a stored chunk holds."""
        return int(self.layout(chunk_id).offsets[-1])

    def get(self, chunk_ids: Iterable[int]) -> dict[int, pa.RecordBatch]:
        chunk_ids = list(dict.fromkeys(chunk_ids))
        self._load_layouts(chunk_ids)
        keys, owners = [], []
        for c in chunk_ids:
            nblocks = len(self._layouts[c].offsets) - 1
            keys += [self.block_key(c, b) for b in range(nblocks)]
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
        self._load_layouts(unique)
        block = np.empty(len(rows), dtype=np.int64)
        local = np.empty(len(rows), dtype=np.int64)
        for c in unique:
            at = chunks == c
            offsets = self._layouts[c].offsets
            b = np.searchsorted(offsets, rows[at], side="right") - 1
            block[at], local[at] = b, rows[at] - offsets[b]
        keys = chunks.astype(np.int64) * (1 << 20) + block  # < 2**20 blocks per chunk
        wanted = np.unique(keys).tolist()
        batches = self._read([self.block_key(k >> 20, k & 0xFFFFF) for k in wanted], [k >> 20 for k in wanted])
        return dict(zip(wanted, batches)), keys, local

    def delete(self, chunk_ids: Iterable[int]) -> None:
        """Delete chunks: their keys, then their files (a chunk not read since a restart
        may have one). Those of a column family already dropped (an insert abandoned
        after DropTable took its table's family) went with it: only forgotten."""
        wb = WriteBatch(raw_mode=True)
        gone, files, writes = [], [], False
        for c in chunk_ids:
            family = self.db.handle.get(self._family_of(c))
            if family is not None:
                wb.delete_range(self.block_key(c, 0), self.block_key(c + 1, 0), family)
                writes = True
            gone.append(c)
            layout = self._layouts.get(c)
            if layout is None or layout.in_file:
                files.append(c)
        if writes:
            self.db.write(wb, "wal")
        if files:
            self._files.delete(files)
        for c in gone:
            self._forget(c)

    def delete_all(self) -> None:
        """Delete every key of this table's chunks (a dropped table's), without reading
        them: its column family is dropped (its files go at once) and its range of the
        legacy family deleted (``Database.reclaim`` gives that space back)."""
        self.db.drop_family(self._cf)
        self._files.delete_all()
        if self._has_legacy:
            wb = WriteBatch(raw_mode=True)
            wb.delete_range(self._prefix, table_prefix(self.table_id + 1), self.db.handle["chunks"])
            self.db.write(wb, "wal")
        for c in list(self._layouts):
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
        keys = [self.block_key(c, _META_BLOCK) for c in chunk_ids]
        metas, bad = self._get_checked(self._cf, keys)
        if self._has_legacy and any(m is None for m in metas):  # written by an older version?
            older = [i for i, m in enumerate(metas) if m is None and keys[i] not in bad]
            legacy, legacy_bad = self._get_checked("chunks", [keys[i] for i in older])
            bad.update(legacy_bad)
            for i, meta in zip(older, legacy):
                metas[i] = meta
                if meta is not None or keys[i] in legacy_bad:
                    self._legacy.add(chunk_ids[i])
        missing, found = [], {}
        for c, key, meta in zip(chunk_ids, keys, metas):
            if key in bad:
                found[c] = f"SSD tier, table id {self.table_id}, chunk {c}, metadata: {bad[key]}"
            elif meta is None:
                missing.append(c)
            elif c not in self._layouts:
                self.commit_put(c, Layout.decode(meta))
        if found and damaged is None:
            raise DataLoss(next(iter(found.values())), damage=dict.fromkeys(found))
        if found:
            damaged.update(found)
        return missing

    def last_chunk_id(self) -> int | None:
        """The greatest chunk id with any key (one seek) or file, or None."""
        keys = [self.db.last_key(cf, self._prefix) for cf in self._families()]
        return max([*(int.from_bytes(k[4:12], "big") for k in keys if k is not None), *self._files.chunk_ids()],
                   default=None)

    def stored_chunks(self) -> list[int]:
        """Every chunk id with a meta key or a file (orphans included: a file is written
        before its meta key), for garbage collection."""
        metas = [int.from_bytes(k[4:12], "big") for cf in self._families() for k, _ in self.db.items(cf, self._prefix)
                 if k[12:] == _META_BLOCK.to_bytes(4, "big")]
        return sorted({*metas, *self._files.chunk_ids()})

    def block_key(self, chunk_id: int, block: int) -> bytes:
        """The RocksDB key of a chunk's block (block 0xFFFFFFFF: its meta value): how
        the corruption tests reach one stored block to damage it."""
        return self._prefix + chunk_id.to_bytes(8, "big") + block.to_bytes(4, "big")

    def file_of(self, chunk_id: int) -> Path | None:
        """The file holding a stored chunk's blocks, or None if RocksDB holds them: where
        the corruption tests reach one block's bytes (``Layout.positions``)."""
        return self._files.path(chunk_id) if self.layout(chunk_id).in_file else None

    # -- internals ----------------------------------------------------------------------

    def _families(self) -> list[str]:
        return [self._cf, "chunks"] if self._has_legacy else [self._cf]

    def _family_of(self, chunk_id: int) -> str:
        return "chunks" if chunk_id in self._legacy else self._cf

    def _get_checked(self, cf: str, keys: list[bytes]) -> tuple[list[bytes | None], dict[bytes, str]]:
        """(values, damaged keys -> why) of a multi-get."""
        try:
            return self.db.get(cf, keys), {}
        except DamagedValues as e:
            return e.values, e.damaged

    def _load_layouts(self, chunk_ids: list[int]) -> None:
        """Read the layouts of chunks not held yet (written before a restart); NotFound
        names the first that is not stored."""
        unknown = [c for c in chunk_ids if c not in self._layouts]
        missing = self.load(unknown) if unknown else []
        if missing:
            raise NotFound(f"chunk {missing[0]} is not in the SSD tier")

    def _read(self, keys: list[bytes], owners: list[int]) -> list[pa.RecordBatch]:
        """Decode the blocks of ``keys`` (of chunks ``owners``). Every damaged block is
        checked, not only the first: the DataLoss names one and its ``damage`` has the
        row ranges of all of them."""
        values, bad = [None] * len(keys), {}
        in_files: dict[int, list[int]] = {}
        for i, c in enumerate(owners):
            if self._layouts[c].in_file:
                in_files.setdefault(c, []).append(i)
        for cf in self._families():  # one multi-get per family
            at = [i for i, c in enumerate(owners) if c not in in_files and self._family_of(c) == cf]
            if at:
                got, damaged = self._get_checked(cf, [keys[i] for i in at])
                bad.update(damaged)
                for i, value in zip(at, got):
                    values[i] = value
        for c, at in in_files.items():
            self._read_file(c, [keys[i] for i in at], at, values, bad)
        out, damage, first = [], {}, None
        for key, chunk, value in zip(keys, owners, values):
            block = int.from_bytes(key[12:], "big")
            what = f"SSD tier, table id {self.table_id}, chunk {chunk}, block {block}"
            try:
                if key in bad:
                    raise DataLoss(f"{what}: {bad[key]}")
                if value is None:
                    raise NotFound(f"{what} is missing")
                layout = self._layouts[chunk]
                out.append(codec.decode_block(value, layout.schema, what,
                                              None if layout.checksums is None else int(layout.checksums[block]),
                                              layout.algorithm))
            except DataLoss as e:
                offsets = self._layouts[chunk].offsets
                damage.setdefault(chunk, []).append((int(offsets[block]), int(offsets[block + 1])))
                first = first or str(e)
        if damage:
            more = sum(map(len, damage.values())) - 1
            raise DataLoss(first + (f" (and {more} more damaged blocks)" if more else ""), damage=damage)
        return out

    def _read_file(self, chunk_id: int, keys: list[bytes], at: list[int], values: list, bad: dict) -> None:
        """Read the blocks ``keys`` of a chunk file into ``values[at]``; a block the file
        does not hold whole goes into ``bad`` (key -> why), as a damaged RocksDB value."""
        positions = self._layouts[chunk_id].positions
        blocks = [int.from_bytes(key[12:], "big") for key in keys]
        spans = [(int(positions[b]), int(positions[b + 1])) for b in blocks]
        try:
            got = self._files.read(chunk_id, spans)
        except FileNotFoundError:
            for key in keys:
                bad[key] = f"its file {self._files.path(chunk_id)} is missing"
            return
        except OSError as e:
            raise _translate(e, f"reading {self._files.path(chunk_id)}") from None
        for i, key, data, (lo, hi) in zip(at, keys, got, spans):
            if len(data) != hi - lo:
                bad[key] = f"its file {self._files.path(chunk_id)} ends before the block's bytes {lo}-{hi}"
            values[i] = data
