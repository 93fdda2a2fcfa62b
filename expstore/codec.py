"""Stored bytes of record batches, and per-column checksums.

A block (``encode_block``) is one Arrow IPC record batch message, without its schema: the
SSD tier keeps the schema once per chunk (parsing a schema with every value cost ~0.7 ms,
more than decoding a 36 KiB row, and the SSD tier reads hundreds of small blocks per
sample). It is stored as it is: in a chunk of 1 MiB or more, in the chunk's file
(tiers/files.py), uncompressed, written by ``encode_blocks`` straight from the rows'
buffers (blocks_native.cpp); in a smaller one, as a RocksDB value, which RocksDB
compresses (LZ4) when it writes it to a blob file at flush, in its own background threads,
and checksums there (a CRC per blob record, verified on every read). The acknowledged
path does not compress. Measured
here on 256 x 36 KiB rows: Python zstd of each ~64 KiB block cost 34-49 ms of the insert's
thread per 9.4 MB batch, more than the WAL write itself (17-23 ms). The writer also
records each block's checksum (``block_checksum``, in the chunk's meta value, so the block
is not copied to prepend it) and ``decode_block`` checks it (a chunk file's only one): end to end, from the bytes
encoded to the bytes read, whatever happened to them in between. The checksum is CRC32C
(the ``crc32c`` package: the CPU's CRC instruction, 0.9 ms per 9.7 MB here, where zlib's
CRC32 took 3.6 ms, on the insert's path and again on every read); chunks written before
recorded zlib's CRC32, and their meta says so (``CHECKSUMS`` holds both).

Blocks written before (``EXK1``: ``magic (4) | crc32 of the rest (4, little endian) |
zstd(IPC record batch message)``) are still read: ``decode_block`` tells them apart by the
magic (an IPC message starts with 0xFFFFFFFF) and checks their CRC as before. A value
that does not decode is reported as DATA_LOSS naming what it was, never as wrong rows.

``column_checksums`` is the CRC32 of each column's Arrow IPC body: what the remote tier
records for a Lance fragment (Lance files carry no checksums) and checks on every read.
IPC writes a column the same way whatever its slicing or chunking, so two reads of the
same stored bytes give the same checksums.
"""

from __future__ import annotations

import os
import zlib
from collections import deque
from typing import Protocol, Sequence

import crc32c
import numpy as np
import pyarrow as pa
import zstandard

from .errors import DataLoss

try:  # after pyarrow, which has loaded the libarrow the module links to
    from . import _blocks_native as native
except ImportError:  # not built: no C++ compiler at install (setup.py)
    native = None
if native is not None and not native.supported():  # no CRC32 instruction
    native = None

LEGACY_BLOCK_MAGIC = b"EXK1"  # zstd + CRC32 blocks, written before blob files
BLOCK_CHECKSUM = "crc32c"  # what blocks are checksummed with now
CHECKSUMS = {"crc32c": crc32c.crc32c, "crc32": zlib.crc32}  # name -> function (crc32: older chunks)


def block_checksum(data) -> int:
    """The checksum (BLOCK_CHECKSUM) of a block's bytes, recorded by its writer."""
    return CHECKSUMS[BLOCK_CHECKSUM](data)


def encode_block(batch: pa.RecordBatch) -> pa.Buffer:
    """One batch without its schema, as an IPC record batch message (a buffer: a file
    write takes it as it is, a RocksDB value copies it into bytes)."""
    return batch.serialize()


class Blocks(Protocol):
    """Blocks encoded for a file, one after another: each one's size and checksum
    (``block_checksum``), and a write of them all. Read the checksums after the write:
    the native encoder computes them as it writes, while the bytes are in the CPU's
    cache (read before, they cost a pass over the bytes of their own)."""
    sizes: Sequence[int]
    checksums: Sequence[int]

    def write_to(self, fd: int) -> None:
        """Write every block, in order, at ``fd``'s position; OSError as the system says."""


def encode_blocks(batches: list[pa.RecordBatch]) -> Blocks:
    """``batches`` as blocks for a file (each ``encode_block``'s bytes). Where it is built,
    the native encoder (blocks_native.cpp) writes them from the batches' own buffers, which
    it holds until it is dropped: serializing copied every row once more before the file
    write copied it again."""
    return native.encode(batches) if native is not None else SerializedBlocks.of(batches)


class SerializedBlocks:
    """Blocks serialized here (``encode_block``): what RocksDB values are made of, and
    what a file is written from where the native encoder is not built."""

    def __init__(self, buffers: list) -> None:  # bytes-like: pa.Buffer, bytes
        self.buffers = buffers
        self.sizes = [len(b) for b in buffers]
        self.checksums = [block_checksum(b) for b in buffers]

    @classmethod
    def of(cls, batches: list[pa.RecordBatch]) -> "SerializedBlocks":
        return cls([encode_block(b) for b in batches])

    def write_to(self, fd: int) -> None:
        """Write every buffer, in order: ``writev`` lets go of the GIL, and may write less
        than it was given."""
        views = deque(memoryview(b).cast("B") for b in self.buffers)
        while views:
            written = os.writev(fd, [views[i] for i in range(min(len(views), _IOV_MAX))])
            while written:
                head = views[0]
                if written >= len(head):
                    written -= len(head)
                    views.popleft()
                else:
                    views[0], written = head[written:], 0
            while views and not len(views[0]):
                views.popleft()


_IOV_MAX = 1024  # buffers one writev takes (Linux)


def decode_block(data, schema: pa.Schema, what: str, checksum: int | None = None,
                 algorithm: str = BLOCK_CHECKSUM) -> pa.RecordBatch:
    """The batch of a block (either format; bytes-like), checked against ``checksum`` (what its writer
    recorded, computed by ``algorithm``, a key of CHECKSUMS; legacy blocks carry their own
    CRC32); DataLoss naming ``what`` if it does not match or does not decode."""
    if memoryview(data)[:4] == LEGACY_BLOCK_MAGIC:
        message = _legacy_body(data, what)
    else:
        if checksum is not None and CHECKSUMS[algorithm](data) != checksum:
            raise DataLoss(f"{what}: checksum mismatch ({len(data)} bytes); the stored value is corrupt")
        message = data
    try:
        return pa.ipc.read_record_batch(pa.py_buffer(message), schema)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataLoss(f"{what}: undecodable block ({len(data)} bytes): {e}") from None


def _legacy_body(data: bytes, what: str) -> bytes:
    """The IPC message of an ``EXK1`` block, its CRC checked."""
    body = memoryview(data)[8:]
    if len(data) < 8 or zlib.crc32(body) != int.from_bytes(data[4:8], "little"):
        raise DataLoss(f"{what}: checksum mismatch ({len(data)} bytes); the stored value is corrupt")
    try:
        return zstandard.ZstdDecompressor().decompress(body)
    except zstandard.ZstdError as e:
        raise DataLoss(f"{what}: undecodable block: {e}") from None


def column_checksums(batch: pa.RecordBatch) -> np.ndarray:
    """The CRC32 of each column (uint32, in schema order), over its IPC serialization."""
    return np.array([zlib.crc32(pa.RecordBatch.from_arrays([column], schema=pa.schema([field])).serialize())
                     for column, field in zip(batch.columns, batch.schema)], dtype=np.uint32)
