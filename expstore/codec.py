"""Stored bytes of record batches: zstd-compressed Arrow IPC, checksummed.

A block is ``magic (4) | crc32 of the rest (4, little endian) | zstd(IPC record batch
message)``, without its schema: the SSD tier keeps the schema once per chunk. Parsing a
schema with every value (an IPC stream) cost ~0.7 ms per value, more than decompressing
a 36 KiB row, and the SSD tier reads hundreds of small blocks per sample. The CRC covers
the stored bytes: a flipped or truncated value is reported as DATA_LOSS naming what it
was, never decoded into wrong rows.

``column_checksums`` is the CRC32 of each column's Arrow IPC body: what the remote tier
records for a Lance fragment (Lance files carry no checksums) and checks on every read.
IPC writes a column the same way whatever its slicing or chunking, so two reads of the
same stored bytes give the same checksums.
"""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa
import zstandard

from .errors import DataLoss

BLOCK_MAGIC = b"EXK1"
ZSTD_LEVEL = 1


def _seal(magic: bytes, body) -> bytes:
    return magic + zlib.crc32(body).to_bytes(4, "little") + bytes(body)


def _open(data: bytes, magic: bytes, what: str) -> memoryview:
    if len(data) < 8 or data[:4] != magic:
        raise DataLoss(f"{what}: not a stored batch (bad header, {len(data)} bytes)")
    body = memoryview(data)[8:]
    if zlib.crc32(body) != int.from_bytes(data[4:8], "little"):
        raise DataLoss(f"{what}: checksum mismatch ({len(data)} bytes); the stored value is corrupt")
    return body


def encode_block(batch: pa.RecordBatch) -> bytes:
    """One batch without its schema (zstandard objects are not thread-safe: one per call)."""
    return _seal(BLOCK_MAGIC, zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(batch.serialize()))


def decode_block(data: bytes, schema: pa.Schema, what: str) -> pa.RecordBatch:
    body = _open(data, BLOCK_MAGIC, what)
    try:
        message = zstandard.ZstdDecompressor().decompress(body)
        return pa.ipc.read_record_batch(pa.py_buffer(message), schema)
    except (zstandard.ZstdError, pa.ArrowInvalid, OSError) as e:
        raise DataLoss(f"{what}: undecodable block: {e}") from None


def column_checksums(batch: pa.RecordBatch) -> np.ndarray:
    """The CRC32 of each column (uint32, in schema order), over its IPC serialization."""
    return np.array([zlib.crc32(pa.RecordBatch.from_arrays([column], schema=pa.schema([field])).serialize())
                     for column, field in zip(batch.columns, batch.schema)], dtype=np.uint32)
