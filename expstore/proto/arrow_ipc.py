"""Arrow IPC framing of the wire's ``bytes`` fields, shared by server and client.

Each field holds a complete Arrow IPC *stream* (schema, record batches, end marker).
Decoding maps the received bytes without copying; encoding may use Arrow's own zstd
buffer compression, which readers undo transparently.
"""

from __future__ import annotations

import pyarrow as pa

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
    """Zero-copy row slices of roughly at most ``max_bytes`` each (by the mean row size)."""
    n = data.num_rows
    if n == 0:
        return [data]
    per_row = max(1, data.nbytes // n)
    rows = max(1, max_bytes // per_row)
    return [data.slice(i, rows) for i in range(0, n, rows)]
