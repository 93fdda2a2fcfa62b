"""How many bytes Arrow rows take once decoded, known before that memory is spent.

An IPC stream with buffer compression (Arrow's zstd: what ``compress=True`` sends) is
small on the wire and large once read. pyarrow allocates each compressed buffer at the
size its 8-byte prefix declares and then decompresses into it, with no hook to refuse:
30 KB can declare a 900 MB row, or a terabyte. :func:`decoded_bytes` adds up what a
stream declares without decompressing anything (:func:`message_bytes`, what one message
declares, for a reader that frames the stream's messages once and decodes them itself).
It reads the record batches' metadata (Arrow's ``Message.fbs`` flatbuffers:
``RecordBatch.buffers`` and ``.compression``; pyarrow hands the metadata out but does
not parse it) and each compressed buffer's prefix. Uncompressed buffers cannot inflate,
but they can overlap: each is counted at its length, as often as it is listed.

Dictionary encoding is the other way to be small on the wire: conforming a dictionary
column to its plain type repeats an entry per row (a 4 MB string referenced 300 times
is 1.2 GB). :func:`row_bytes` gives every row's size with dictionaries expanded, from
offsets and widths alone (vectorised, nothing copied), for refusing rows no response
message could carry and for splitting batches with dictionaries by their rows' real
sizes.
"""

from __future__ import annotations

import struct
import sys
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3  # MessageHeader union types
_UNCOMPRESSED = -1  # a compressed body's buffer prefix: this buffer was left as it is
_LITTLE_ENDIAN = 0  # Schema.endianness
_U8, _U16, _I16, _U32, _I32, _I64 = (struct.Struct(f) for f in ("<B", "<H", "<h", "<I", "<i", "<q"))


def decoded_bytes(data) -> int:
    """The bytes the record batches of IPC stream ``data`` take once read (see
    :func:`message_bytes`). Raises ValueError (or pa.ArrowInvalid) when the stream is
    malformed."""
    return sum(message_bytes(m) for m in pa.ipc.MessageReader.open_stream(pa.py_buffer(data)))


def message_bytes(message: pa.ipc.Message) -> int:
    """The bytes the buffers of one IPC message take once read, from its metadata alone:
    a record batch's (or a dictionary batch's) buffers at the lengths they declare, and
    compressed ones at the decompressed sizes their prefixes declare; 0 for any other
    message (a schema). Reading makes each buffer exactly that size, or fails, so this
    is at least the batch's ``nbytes`` (a buffer is counted as often as the metadata
    lists it). Raises ValueError when the metadata is malformed: a negative length, a
    compressed buffer outside the body. ~9 us for 8 trajectory rows (57 buffers)."""
    meta = _Flatbuffer(message.metadata)
    batch = _batch_table(meta)
    if batch is None:
        return 0
    buffers = _buffers(meta, batch)
    lengths = buffers[1::2]
    if lengths and min(lengths) < 0:
        raise ValueError("a buffer declares a negative length")
    if meta.field(batch, 3) is None:  # RecordBatch.compression unset: read in place
        return sum(lengths)
    body = message.body
    view, total = memoryview(body), 0
    for offset, length in zip(buffers[0::2], lengths):
        if length == 0:
            continue
        if offset < 0 or length < 8 or offset + length > body.size:
            raise ValueError("a compressed buffer lies outside the message body")
        declared = _I64.unpack_from(view, offset)[0]
        if declared < _UNCOMPRESSED:
            raise ValueError(f"a compressed buffer declares a negative size ({declared})")
        total += length - 8 if declared == _UNCOMPRESSED else declared
    return total


def native_byte_order(schema_message: pa.ipc.Message) -> bool:
    """Whether a schema message's buffers are in this machine's byte order (Arrow's
    stream reader swaps the others' as it reads them). Raises ValueError when the
    message is not a schema or its metadata is malformed."""
    meta = _Flatbuffer(schema_message.metadata)
    message = meta.root()
    kind_at, header_at = meta.field(message, 1), meta.field(message, 2)
    if kind_at is None or header_at is None or meta.unpack(_U8, kind_at) != _SCHEMA:
        raise ValueError("the stream does not start with a schema")
    at = meta.field(meta.deref(header_at), 0)
    little = at is None or meta.unpack(_I16, at) == _LITTLE_ENDIAN
    return little == (sys.byteorder == "little")


def _batch_table(meta: "_Flatbuffer") -> int | None:
    """The position of the RecordBatch table of a Message (a DictionaryBatch's data), or
    None for other messages (the schema)."""
    message = meta.root()
    kind_at, header_at = meta.field(message, 1), meta.field(message, 2)
    kind = meta.unpack(_U8, kind_at) if kind_at is not None else 0
    if kind not in (_DICTIONARY_BATCH, _RECORD_BATCH) or header_at is None:
        return None
    header = meta.deref(header_at)
    if kind == _DICTIONARY_BATCH:
        data_at = meta.field(header, 1)
        return None if data_at is None else meta.deref(data_at)
    return header


def _buffers(meta: "_Flatbuffer", batch: int) -> tuple[int, ...]:
    """RecordBatch.buffers: offset, length, offset, length, ... (structs of two int64)."""
    at = meta.field(batch, 2)
    if at is None:
        return ()
    vector = meta.deref(at)
    n = meta.unpack(_U32, vector)
    meta.check(vector + 4, 16 * n)
    return struct.unpack_from(f"<{2 * n}q", meta.data, vector + 4)


class _Flatbuffer:
    """Bounds-checked reads of a flatbuffer: tables, their fields by slot, offsets."""

    def __init__(self, buffer: pa.Buffer) -> None:
        self.data = memoryview(buffer)
        self.size = len(self.data)

    def check(self, pos: int, size: int) -> None:
        if pos < 0 or size < 0 or pos + size > self.size:
            raise ValueError("malformed IPC message metadata")

    def unpack(self, fmt: struct.Struct, pos: int):
        if pos < 0 or pos + fmt.size > self.size:
            raise ValueError("malformed IPC message metadata")
        return fmt.unpack_from(self.data, pos)[0]

    def root(self) -> int:
        return self.deref(0)

    def deref(self, pos: int) -> int:
        """The table or vector an offset field at ``pos`` points to."""
        return pos + self.unpack(_U32, pos)

    def field(self, table: int, slot: int) -> int | None:
        """Where field number ``slot`` of the table at ``table`` is stored; None if unset."""
        vtable = table - self.unpack(_I32, table)
        if 4 + 2 * slot + 2 > self.unpack(_U16, vtable):
            return None
        offset = self.unpack(_U16, vtable + 4 + 2 * slot)
        return table + offset if offset else None


class _Recent:
    """The answers for the last ``size`` keys asked about, most recently used first;
    ``same(seen, key)`` tells a remembered key from another. The list is replaced, never
    changed in place: safe from any thread (a race loses at most one remembered answer)."""

    def __init__(self, size: int, same: Callable[[Any, Any], bool]) -> None:
        self._size, self._same = size, same
        self._items: list[tuple[Any, Any]] = []

    def answer(self, key: Any, fn: Callable[[], Any]) -> Any:
        """The remembered answer for ``key``, or ``fn()`` remembered (unless it raises)."""
        items = self._items
        for i, (seen, answer) in enumerate(items):
            if self._same(seen, key):
                if i:
                    self._items = [items[i]] + items[:i] + items[i + 1:]
                return answer
        answer = fn()
        self._items = [(key, answer)] + items[:self._size - 1]
        return answer


class SchemaMemo:
    """``fn(schema)`` for the last ``size`` schemas it was asked about, by equality: a
    producer sends one schema call after call, and walking its fields in Python costs
    ~50 us for a trajectory's where ``Schema.equals`` costs well under one. Equal schemas
    have the same field names (bytes) and types, not necessarily the same metadata: for
    functions of names and types only, unless ``check_metadata`` (then equal schemas
    have the same schema and field metadata too). A call that raises is not remembered."""

    def __init__(self, fn: Callable[[pa.Schema], Any], size: int = 8, check_metadata: bool = False) -> None:
        self._fn = fn
        self._recent = _Recent(size, lambda seen, schema: seen.equals(schema, check_metadata=check_metadata))

    def __call__(self, schema: pa.Schema) -> Any:
        return self._recent.answer(schema, lambda: self._fn(schema))


class SchemaMessageMemo:
    """``fn(message)`` for the last ``size`` schema messages it was asked about, by their
    bytes: a producer sends one schema call after call, and reading it again costs more
    than comparing its bytes (a trajectory's: 2.7 KB, read by ``pa.ipc.read_schema`` in
    ~10 us, and a schema read afresh costs ~13 us more in its first ``Schema.equals``,
    which computes its fingerprint; the same bytes compare in well under a microsecond).
    Equal bytes are the same schema, metadata and byte order included. A message of more
    than ``max_bytes`` (or with a body) is answered but not remembered: the memo holds at
    most ``size * max_bytes``. A call that raises is not remembered."""

    def __init__(self, fn: Callable[[pa.ipc.Message], Any], size: int = 8, max_bytes: int = 64 << 10) -> None:
        self._fn, self._max_bytes = fn, max_bytes
        self._recent = _Recent(size, bytes.__eq__)

    def __call__(self, message: pa.ipc.Message) -> Any:
        metadata = message.metadata
        if metadata.size > self._max_bytes or message.body.size:
            return self._fn(message)
        return self._recent.answer(metadata.to_pybytes(), lambda: self._fn(message))


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
