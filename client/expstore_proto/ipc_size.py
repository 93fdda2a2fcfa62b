"""How many bytes Arrow rows take once decoded, known before that memory is spent.

An IPC stream with buffer compression (Arrow's zstd: what ``compress=True`` sends) is
small on the wire and large once read. pyarrow allocates each compressed buffer at the
size its 8-byte prefix declares and then decompresses into it, with no hook to refuse:
30 KB can declare a 900 MB row, or a terabyte. :func:`decoded_bytes` adds up what a
stream declares without decompressing anything. It reads the record batches' metadata
(Arrow's ``Message.fbs`` flatbuffers: ``RecordBatch.buffers`` and ``.compression``; pyarrow
hands the metadata out but does not parse it) and each compressed buffer's prefix.

Dictionary encoding is the other way to be small on the wire: conforming a dictionary
column to its plain type repeats an entry per row (a 4 MB string referenced 300 times
is 1.2 GB). :func:`row_bytes` gives every row's size with dictionaries expanded, from
offsets and widths alone (vectorised, nothing copied), for refusing rows no response
message could carry and for splitting batches with dictionaries by their rows' real
sizes.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_DICTIONARY_BATCH, _RECORD_BATCH = 2, 3  # MessageHeader union types
_UNCOMPRESSED = -1  # a compressed body's buffer prefix: this buffer was left as it is


def decoded_bytes(data) -> int:
    """The bytes the record batches of IPC stream ``data`` take once read: compressed
    buffers at their declared decompressed sizes, others as they are. Raises ValueError
    (or pa.ArrowInvalid) when the stream is malformed."""
    total = 0
    for message in pa.ipc.MessageReader.open_stream(pa.py_buffer(data)):
        meta = _Flatbuffer(message.metadata)
        batch = _batch_table(meta)
        if batch is None:
            continue
        body = message.body
        if meta.field(batch, 3) is None:  # RecordBatch.compression unset: read in place
            total += body.size
            continue
        view = memoryview(body)
        for offset, length in _buffers(meta, batch):
            if length == 0:
                continue
            if offset < 0 or length < 8 or offset + length > body.size:
                raise ValueError("a compressed buffer lies outside the message body")
            declared = struct.unpack_from("<q", view, offset)[0]
            if declared < _UNCOMPRESSED:
                raise ValueError(f"a compressed buffer declares a negative size ({declared})")
            total += length - 8 if declared == _UNCOMPRESSED else declared
    return total


def _batch_table(meta: "_Flatbuffer") -> int | None:
    """The position of the RecordBatch table of a Message (a DictionaryBatch's data), or
    None for other messages (the schema)."""
    message = meta.root()
    kind_at, header_at = meta.field(message, 1), meta.field(message, 2)
    kind = meta.unpack("<B", kind_at) if kind_at is not None else 0
    if kind not in (_DICTIONARY_BATCH, _RECORD_BATCH) or header_at is None:
        return None
    header = meta.deref(header_at)
    if kind == _DICTIONARY_BATCH:
        data_at = meta.field(header, 1)
        return None if data_at is None else meta.deref(data_at)
    return header


def _buffers(meta: "_Flatbuffer", batch: int) -> list[tuple[int, int]]:
    """RecordBatch.buffers: (offset, length) pairs, structs of two int64 each."""
    at = meta.field(batch, 2)
    if at is None:
        return []
    vector = meta.deref(at)
    n = meta.unpack("<I", vector)
    meta.check(vector + 4, 16 * n)
    return [struct.unpack_from("<qq", meta.data, vector + 4 + 16 * i) for i in range(n)]


class _Flatbuffer:
    """Bounds-checked reads of a flatbuffer: tables, their fields by slot, offsets."""

    def __init__(self, buffer: pa.Buffer) -> None:
        self.data = memoryview(buffer)

    def check(self, pos: int, size: int) -> None:
        if pos < 0 or size < 0 or pos + size > len(self.data):
            raise ValueError("malformed IPC message metadata")

    def unpack(self, fmt: str, pos: int):
        self.check(pos, struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.data, pos)[0]

    def root(self) -> int:
        return self.deref(0)

    def deref(self, pos: int) -> int:
        """The table or vector an offset field at ``pos`` points to."""
        return pos + self.unpack("<I", pos)

    def field(self, table: int, slot: int) -> int | None:
        """Where field number ``slot`` of the table at ``table`` is stored; None if unset."""
        vtable = table - self.unpack("<i", table)
        if 4 + 2 * slot + 2 > self.unpack("<H", vtable):
            return None
        offset = self.unpack("<H", vtable + 4 + 2 * slot)
        return table + offset if offset else None


class SchemaMemo:
    """``fn(schema)`` for the last ``size`` schemas it was asked about, by equality: a
    producer sends one schema call after call, and walking its fields in Python costs
    ~50 us for a trajectory's where ``Schema.equals`` costs well under one. Equal schemas
    have the same field names (bytes) and types, not necessarily the same metadata: for
    functions of names and types only, unless ``check_metadata`` (then equal schemas
    have the same schema and field metadata too). A call that raises is not remembered."""

    def __init__(self, fn: Callable[[pa.Schema], Any], size: int = 8, check_metadata: bool = False) -> None:
        self._fn, self._size, self._check_metadata = fn, size, check_metadata
        self._recent: list[tuple[pa.Schema, Any]] = []  # most recently used first

    def __call__(self, schema: pa.Schema) -> Any:
        recent = self._recent  # replaced, never changed in place: safe from any thread
        for i, (seen, answer) in enumerate(recent):
            if seen.equals(schema, check_metadata=self._check_metadata):
                if i:
                    self._recent = [recent[i]] + recent[:i] + recent[i + 1:]
                return answer
        answer = self._fn(schema)
        self._recent = [(schema, answer)] + recent[:self._size - 1]
        return answer


def has_dictionary(t: pa.DataType | pa.Schema) -> bool:
    """Whether a type (or any field of a schema) is dictionary-encoded at any depth."""
    if isinstance(t, pa.Schema):
        return _schema_has_dictionary(t)
    return pa.types.is_dictionary(t) or any(has_dictionary(t.field(i).type) for i in range(t.num_fields))


_schema_has_dictionary = SchemaMemo(lambda schema: any(has_dictionary(f.type) for f in schema))


def row_bytes(data: pa.Table | pa.RecordBatch) -> np.ndarray:
    """Each row's bytes (int64): values, offsets and fixed-width slots, dictionaries
    expanded (validity bits not counted). O(rows + nested values), vectorised; a list
    of fixed-width values costs O(rows)."""
    total = np.zeros(data.num_rows, np.int64)
    for column in data.columns:
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        if chunks:
            total += np.concatenate([np.broadcast_to(_array_bytes(c), len(c)) for c in chunks])
    return total


def _array_bytes(arr: pa.Array) -> np.ndarray | int:
    """Per-row bytes of ``arr``, or one int when every row takes the same."""
    t, n = arr.type, len(arr)
    if n == 0:
        return 0
    if pa.types.is_dictionary(t):
        entries = np.broadcast_to(_array_bytes(arr.dictionary), len(arr.dictionary))
        indices = arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return t.index_type.bit_width // 8 + (entries[indices] if len(entries) else 0)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        width = 8 if pa.types.is_large_list(t) else 4
        offsets = arr.offsets.to_numpy().astype(np.int64)
        inner = _array_bytes(arr.values.slice(offsets[0], offsets[-1] - offsets[0]))
        if isinstance(inner, int):
            return width + np.diff(offsets) * inner
        sums = np.concatenate([[0], np.cumsum(inner)])
        return width + sums[offsets[1:] - offsets[0]] - sums[offsets[:-1] - offsets[0]]
    if pa.types.is_fixed_size_list(t):
        k = t.list_size
        inner = _array_bytes(arr.values.slice(arr.offset * k, n * k))
        return inner * k if isinstance(inner, int) else inner.reshape(n, k).sum(axis=1)
    if pa.types.is_struct(t):
        return sum((_array_bytes(arr.field(i)) for i in range(t.num_fields)), 0)
    if pa.types.is_binary(t) or pa.types.is_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_string(t):
        width = 8 if pa.types.is_large_binary(t) or pa.types.is_large_string(t) else 4
        return width + pc.binary_length(arr).fill_null(0).to_numpy().astype(np.int64)
    if pa.types.is_null(t):
        return 0
    try:
        return (t.bit_width + 7) // 8
    except ValueError:  # views, unions, run-end encoded: the mean, rounded up
        return -(-arr.nbytes // n)
