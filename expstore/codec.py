"""Stored bytes of record batches: Arrow IPC with zstd buffer compression, checksummed.

Layout: ``b"EXB1" | crc32 (4 bytes, little endian) | IPC stream``. Arrow compresses each
buffer with zstd in C++ and decompresses it on read, so a token column costs one pass of
zstd each way and no Python per row. The CRC covers the IPC bytes: a flipped or truncated
value is reported as DATA_LOSS naming what it was, never decoded into wrong rows.
"""

from __future__ import annotations

import zlib

import pyarrow as pa

from .errors import DataLoss

MAGIC = b"EXB1"
_ZSTD = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=1))


def encode(batch: pa.RecordBatch | pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=_ZSTD) as writer:
        writer.write(batch)
    body = sink.getvalue()
    return MAGIC + zlib.crc32(body).to_bytes(4, "little") + body.to_pybytes()


def decode(data: bytes, what: str) -> pa.RecordBatch:
    """The batch stored in ``data``; DataLoss (naming ``what``) when the bytes are damaged."""
    if len(data) < 8 or data[:4] != MAGIC:
        raise DataLoss(f"{what}: not a stored batch (bad header, {len(data)} bytes)")
    body = memoryview(data)[8:]
    if zlib.crc32(body) != int.from_bytes(data[4:8], "little"):
        raise DataLoss(f"{what}: checksum mismatch ({len(data)} bytes); the stored value is corrupt")
    try:
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    except (pa.ArrowInvalid, OSError) as e:  # a valid CRC over invalid IPC: written wrong
        raise DataLoss(f"{what}: undecodable Arrow IPC: {e}") from None
    return table.combine_chunks().to_batches()[0] if table.num_rows else \
        pa.RecordBatch.from_pylist([], schema=table.schema)
