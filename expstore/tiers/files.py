"""Chunk files: the blocks of a table's large chunks, one file per chunk, beside RocksDB.

A chunk of at least ``rocks.FILE_BYTES`` is stored as one file holding its blocks (the
same IPC messages as RocksDB values, ``codec``) one after another; RocksDB keeps only
its meta value, which adds each block's byte position in the file to its row offsets and
checksums. Why not RocksDB's blob files, which do this in C++: rocksdict 0.3.29's RocksDB
computes CRC32C in software, on the write-ahead log record of every value and again on
its blob record at the flush, and holds the GIL through the whole log write. Measured
here on 256 rows of 36 KiB (9.7 MB of blocks): a RocksDB write took 18 ms (median of 30)
against 2.2 ms for ``writev`` of the same blocks into a file, which lets go of the GIL;
in a server taking such inserts back to back, RocksDB's CRC was 29% of its CPU and the
flush's LZ4 another 9%. Each block keeps its end-to-end checksum (CRC32C on the CPU's
instruction, recorded in the meta value and checked on every read); what the file does
not have is RocksDB's second CRC of the same bytes and its LZ4 (0.78 of the bytes on
realistic tokens): large chunks take that much more disk.

Layout: ``<directory>/<chunk id>.blocks``. A file is written as ``<chunk id>.blocks.partial``
and renamed once whole, so a file under its final name is complete and never changes
(checkpoints hard-link them, ``link_all``). The caller writes the chunk's meta key after
the file: a crash between the two leaves a file no meta key names, an orphan that
recovery deletes with every unreferenced chunk (``chunk_ids`` lists files of both
names), and a chunk's file is deleted after its keys. Durability follows the meta key's:
at ``wal`` the file is in the page cache when the insert is acknowledged, as the log is
(it survives a killed server); at ``fsync`` it is fdatasync'd, and its directory synced,
before the meta key is written.

Files are only ever created, renamed and deleted here, by chunk id, under the table's own
directory, and as spares (``Spares``, ``<n>.spare`` in the directory of the tables'
directories): nothing else is touched, and names that are not a chunk's or a spare's are
left where they are. Deleting files and a checkpoint's linking of them exclude each other
(``removing``, the database's lock), so a checkpoint never lacks the file of a chunk
whose meta key it holds.

Recycling: a deleted chunk's file is kept as a spare (renamed, up to ``MAX_SPARES``), and
the next chunk written over it (RocksDB reuses its logs so, ``recycle_log_file_num``).
Unlinking a file whose pages are in the page cache makes the kernel drop each page (an
insert that evicts the oldest chunk paid ~1.5 ms for 9.4 MB here, under the table's
lock), and a new file takes fresh pages and disk blocks; written over a spare, the pages
and blocks are reused. A spare is only ever a deleted chunk's file, whose meta key went
first, and never one a checkpoint has linked (its bytes must not change: ``Spares.keep``
checks the link count under ``removing``). Measured here, 256 rows of 36 KiB into a full
durable table: 8.1-8.3 ms an insert in process instead of 9.5-9.6.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from pathlib import Path
from typing import Iterable

from ..codec import Blocks

SUFFIX = ".blocks"  # a whole chunk file
PARTIAL = ".partial"  # appended while it is being written
SPARE = ".spare"  # a deleted chunk's file, to be written over (Spares)
MAX_SPARES = 2  # a steady stream of inserts evicting as many chunks as they write needs one


class Spares:
    """Deleted chunks' files kept to be written over by the next chunks (see the module
    docstring): at most ``limit``, in ``directory`` as ``<n>.spare``, one pool for every
    table of a database. Those a previous run left are deleted when the pool is made."""

    def __init__(self, directory: Path, limit: int = MAX_SPARES) -> None:
        self.directory, self.limit = directory, limit
        self._held: list[tuple[Path, int]] = []  # (path, bytes)
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        for name in os.listdir(directory):
            if name.endswith(SPARE) and name[:-len(SPARE)].isdigit():
                (directory / name).unlink(missing_ok=True)

    def keep(self, path: Path) -> bool:
        """Take the file at ``path`` as a spare (renamed); False where there is no room,
        no file, or another link to it (a checkpoint's): the caller deletes it then. The
        caller holds the lock that a checkpoint's linking takes."""
        with self._lock:
            if len(self._held) >= self.limit:
                return False
            try:
                st = os.stat(path)
                if st.st_nlink != 1:
                    return False
                spare = self.directory / f"{next(self._numbers)}{SPARE}"
                os.rename(path, spare)
            except FileNotFoundError:
                return False
            self._held.append((spare, st.st_size))
            return True

    def release(self) -> int:
        """Delete every spare (their disk space is wanted); returns how many there were."""
        with self._lock:
            held, self._held = self._held, []
        for spare, _ in held:
            spare.unlink(missing_ok=True)
        return len(held)

    def take(self, path: Path, nbytes: int) -> bool:
        """Rename the spare closest to ``nbytes`` in length to ``path`` (replacing any
        file there); False if there is none. The bytes a write over it adds or cuts are
        what it costs: fresh pages, or pages the kernel drops as an unlink does (4.3 ms
        here to cut a freshly written 8.8 MB file to 1.2 MB). An insert over Flight of
        256 x 36 KiB rows arrives as chunks of those two sizes and leaves a spare of each."""
        with self._lock:
            if not self._held:
                return False
            best = min(range(len(self._held)), key=lambda i: abs(self._held[i][1] - nbytes))
            spare, _ = self._held.pop(best)
        try:
            os.rename(spare, path)
        except FileNotFoundError:  # removed by someone else: the caller makes a new file
            return False
        return True


class ChunkFiles:
    """One table's chunk files, in ``directory`` (created on the first write, in a parent
    that exists); ``spares``: where deleted files are kept to be written over (None: they
    are unlinked). Raises OSError as the system does; the SSD tier says what failed."""

    def __init__(self, directory: Path, removing: threading.Lock, spares: Spares | None = None) -> None:
        self.directory = directory
        self._removing = removing
        self._spares = spares

    def path(self, chunk_id: int) -> Path:
        return self.directory / f"{chunk_id}{SUFFIX}"

    def write(self, chunk_id: int, blocks: Blocks, sync: bool) -> None:
        """Store ``blocks`` as chunk ``chunk_id``'s file, replacing any. ``sync``: on disk
        (file and name) before this returns. A failed write leaves no file behind."""
        path = self.path(chunk_id)
        partial = path.with_name(path.name + PARTIAL)
        make_directory(self.directory)
        try:
            nbytes = sum(blocks.sizes)
            if self._spares is not None:
                self._spares.take(partial, nbytes)  # written over, where there is one
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                blocks.write_to(fd)
                if os.fstat(fd).st_size > nbytes:  # a spare's bytes past the blocks go
                    os.ftruncate(fd, nbytes)  # (not at the same length: 2.6 ms on a fresh 8.8 MB file)
                if sync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.rename(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        if sync:
            _sync_directory(self.directory)

    def read(self, chunk_id: int, spans: list[tuple[int, int]]) -> list[memoryview]:
        """The bytes [lo, hi) of each span of a chunk's file (shorter where the file ends
        first), with one read per run of adjacent spans. FileNotFoundError if it has none."""
        order = sorted(range(len(spans)), key=lambda i: spans[i][0])
        out: list[memoryview] = [memoryview(b"")] * len(spans)
        fd = os.open(self.path(chunk_id), os.O_RDONLY | os.O_CLOEXEC)
        try:
            run: list[int] = []
            for i in [*order, None]:
                if run and (i is None or spans[i][0] != spans[run[-1]][1]):
                    lo = spans[run[0]][0]
                    data = memoryview(os.pread(fd, spans[run[-1]][1] - lo, lo))
                    for j in run:
                        out[j] = data[spans[j][0] - lo:spans[j][1] - lo]
                    run = []
                if i is not None:
                    run.append(i)
        finally:
            os.close(fd)
        return out

    def delete(self, chunk_ids: Iterable[int]) -> None:
        """Delete the files (whole or partial) of ``chunk_ids`` (a file may be kept as a
        spare); those without one are skipped."""
        with self._removing:
            for c in chunk_ids:
                path = self.path(c)
                if self._spares is None or not self._spares.keep(path):
                    path.unlink(missing_ok=True)
                path.with_name(path.name + PARTIAL).unlink(missing_ok=True)

    def delete_all(self) -> None:
        """Delete every chunk file, then the directory if nothing else is in it; and the
        spares, whose space is as much the drop's to give back."""
        self.delete(self.chunk_ids())
        if self._spares is not None:
            self._spares.release()
        try:
            self.directory.rmdir()
        except OSError:
            pass  # absent, or holds what this class did not create: left alone

    def chunk_ids(self) -> list[int]:
        """The chunks with a file, whole or partial (orphans included), ascending."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted({int(stem) for stem in map(_chunk_stem, names) if stem is not None})


def make_directory(path: Path) -> None:
    """Create ``path`` unless it is there, its parent synced after (once a file in it is
    synced, so is the way to it). Its parent must exist."""
    if path.is_dir():
        return
    path.mkdir(exist_ok=True)
    _sync_directory(path.parent)


def link_all(root: Path, dest: Path) -> None:
    """Hard-link every whole chunk file under ``root`` (``<table id>/<chunk>.blocks``) into
    the same place under ``dest`` (copied where a link is impossible). The caller holds
    the lock that file deletes take."""
    if not root.is_dir():
        return
    for table in sorted(root.iterdir()):
        if not table.is_dir() or not table.name.isdigit():
            continue
        for name in sorted(os.listdir(table)):
            if not name.endswith(PARTIAL) and _chunk_stem(name) is not None:  # whole files only
                target = dest / table.name / name
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(table / name, target)
                except OSError:
                    shutil.copyfile(table / name, target)


def _chunk_stem(name: str) -> str | None:
    """The chunk id of a file name this module writes, or None."""
    if name.endswith(PARTIAL):
        name = name[:-len(PARTIAL)]
    stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
    return stem if stem.isdigit() else None


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
