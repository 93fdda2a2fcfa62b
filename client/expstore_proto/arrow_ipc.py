"""Arrow IPC framing of the wire's ``bytes`` fields, shared by server and client.

Each field holds a complete Arrow IPC *stream* (schema, record batches, end marker).
Decoding maps the received bytes without copying; encoding may use Arrow's own zstd
buffer compression, which readers undo transparently.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from . import ipc_size

_PLAIN = pa.ipc.IpcWriteOptions()
_ZSTD = pa.ipc.IpcWriteOptions(compression="zstd")


def encode(data: pa.RecordBatch | pa.Table, *, compress: bool = False) -> pa.Buffer:
    """An IPC stream in an Arrow buffer (buffer protocol; ``.to_pybytes()`` for protobuf)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema, options=_ZSTD if compress else _PLAIN) as writer:
        writer.write(data)
    return sink.getvalue()


def encode_schema(schema: pa.Schema) -> bytes:
    return schema.serialize().to_pybytes()


def decode(data) -> pa.Table:
    """An IPC stream (bytes, memoryview, pa.Buffer) -> pa.Table whose buffers point into
    ``data`` (no copy unless compressed)."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def decode_schema(data: bytes) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(data))


def split_rows(data: pa.RecordBatch | pa.Table, max_bytes: int) -> list:
    """Zero-copy slices of consecutive rows, each at most ``max_bytes`` by its rows'
    sizes (``ipc_size.row_bytes``), or a single row larger than that on its own: a few
    long rows among short ones never share a slice that passes the limit."""
    n = data.num_rows
    if n == 0 or (data.nbytes <= max_bytes and not ipc_size.has_dictionary(data.schema)):
        return [data]
    ends = np.cumsum(ipc_size.row_bytes(data))
    parts, start = [], 0
    while start < n:
        before = int(ends[start - 1]) if start else 0
        end = max(start + 1, int(np.searchsorted(ends, before + max_bytes, side="right")))
        parts.append(data.slice(start, end - start))
        start = end
    return parts
