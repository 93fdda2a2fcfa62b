"""expstore_proto.ipc_size: decoded sizes read before decoding, row sizes, and splitting
batches by them."""

from __future__ import annotations

import struct
import sys
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expstore_proto import arrow_ipc, ipc_size
from expstore.synthetic import trajectories


def stream(data: pa.Table, compression: str | None) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write(data)
    return sink.getvalue().to_pybytes()


def mixed() -> pa.Table:
    """Every kind of column the sizes handle, sliced (offsets not starting at 0)."""
    n = 40
    data = trajectories(n, tokens=(10, 300), groups=4).append_column(
        "code", pa.array([f"c{i % 3}" * (i % 7) for i in range(n)]).dictionary_encode())
    data = data.append_column("pairs", pa.array([[i, i + 1] for i in range(n)], pa.list_(pa.int64(), 2)))
    data = data.append_column("big", pa.array([[f"{i}"] * (i % 4) for i in range(n)], pa.large_list(pa.large_string())))
    data = data.append_column("flags", pa.array([i % 2 == 0 for i in range(n)]))
    return data.slice(3, 30)


@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
def test_decoded_bytes_is_what_reading_takes(compression):
    data = mixed()
    payload = stream(data, compression)
    declared = ipc_size.decoded_bytes(payload)
    decoded = arrow_ipc.decode(payload)
    buffers = sum(b.size for col in decoded.columns for chunk in col.chunks for b in chunk.buffers() if b)
    buffers += sum(b.size for col in decoded.columns for chunk in col.chunks
                   if pa.types.is_dictionary(chunk.type) for b in chunk.dictionary.buffers() if b)
    # Every buffer is counted at its size once read (padding between them is not).
    assert declared == buffers
    if compression:
        assert declared > len(payload)


def test_a_declared_size_is_counted_without_decompressing():
    n = 1_000_000
    data = pa.table({"tokens": pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), pa.array(np.zeros(n, np.int32)))})
    payload = stream(data, "zstd")
    assert len(payload) < 10_000 and ipc_size.decoded_bytes(payload) >= 4 * n
    lie = payload.replace(struct.pack("<q", 4 * n), struct.pack("<q", 1 << 50))
    assert ipc_size.decoded_bytes(lie) >= 1 << 50


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_metadata_raises_never_crashes(data):
    payload = bytearray(stream(mixed(), "zstd"))
    for _ in range(data.draw(st.integers(1, 8))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    try:
        assert ipc_size.decoded_bytes(bytes(payload)) >= 0
    except (ValueError, OSError, pa.ArrowException):  # what decode_rows turns into INVALID_ARGUMENT
        pass


def test_row_bytes_match_each_rows_own_bytes():
    data = mixed()
    sizes = ipc_size.row_bytes(data)
    plain = data.set_column(data.schema.get_field_index("code"), "code", data.column("code").cast(pa.string()))
    own = np.array([plain.slice(i, 1).nbytes for i in range(data.num_rows)])
    assert np.all(np.abs(sizes - own) <= 8)  # validity bits are not counted
    assert np.all(sizes - ipc_size.row_bytes(plain) == 4)  # and the dictionary's int32 index
    assert ipc_size.row_bytes(data.slice(0, 0)).tolist() == []


def test_row_bytes_expand_dictionaries_at_any_depth():
    entry = pa.array(["x" * 1000, "y"])
    strings = pa.DictionaryArray.from_arrays(pa.array([0, 0, 1, None], pa.int8()), entry)
    lists = pa.ListArray.from_arrays(pa.array([0, 3, 4], pa.int32()), strings)
    assert ipc_size.has_dictionary(pa.schema([("l", lists.type)]))
    assert not ipc_size.has_dictionary(pa.schema([("l", pa.list_(pa.string()))]))
    assert ipc_size.row_bytes(pa.table({"l": lists})).tolist() == [4 + 3 * 1 + 1004 * 2 + 5, 4 + 1 + 1004]


def test_split_rows_keeps_every_slice_within_the_limit_or_alone():
    short = trajectories(30, tokens=32, id_prefix="s")
    long = trajectories(3, tokens=20_000, id_prefix="l")
    data = pa.concat_tables([short.slice(0, 10), long, short.slice(10)])
    sizes = ipc_size.row_bytes(data)
    limit = int(sizes.max()) + 1000  # a long row and a few short ones fit; two long rows do not
    parts = arrow_ipc.split_rows(data, limit)
    assert sum(p.num_rows for p in parts) == data.num_rows
    assert pa.concat_tables(parts).column("traj_id").to_pylist() == data.column("traj_id").to_pylist()
    assert all(p.nbytes <= limit for p in parts)
    assert arrow_ipc.split_rows(data, 1) and all(p.num_rows == 1 for p in arrow_ipc.split_rows(data, 1))
    assert arrow_ipc.split_rows(data, data.nbytes) == [data]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 3_000), min_size=1, max_size=60), limit=st.integers(1, 40_000),
       dictionary=st.booleans())
def test_split_rows_cuts_any_rows_in_order_within_the_limit(lengths, limit, dictionary):
    """Rows of any sizes: the slices hold every row once, in order; each is within the
    limit (by Arrow's bytes, or with dictionaries by the rows' expanded sizes) or is one
    row; and rows of one size take at most twice the fewest messages the limit allows."""
    tags = pa.array([f"t{i % 3}" for i in range(len(lengths))])
    data = pa.table({"i": np.arange(len(lengths)),
                     "tokens": pa.array([list(range(k)) for k in lengths], pa.list_(pa.int32())),
                     "tag": tags.dictionary_encode() if dictionary else tags})
    parts = arrow_ipc.split_rows(data, limit)
    assert pa.concat_tables(parts).column("i").to_pylist() == list(range(len(lengths)))
    for p in parts:
        size = int(ipc_size.row_bytes(p).sum()) if dictionary else p.nbytes
        assert p.num_rows == 1 or size <= limit
    even = pa.table({"tokens": pa.array([[7] * 500] * len(lengths), pa.list_(pa.int32()))})
    row = even.slice(0, 1).nbytes
    fewest = -(-len(lengths) // max(1, limit // row))
    assert len(arrow_ipc.split_rows(even, limit)) <= 2 * fewest


def test_schema_memo_answers_equal_schemas_from_memory():
    """A producer's schema, call after call, is walked once; another schema (a name or a
    type apart) is walked again; an answer that raised is not remembered."""
    calls = []

    def walk(schema: pa.Schema) -> list[str]:
        calls.append(schema)
        if "bad" in schema.names:
            raise ValueError("bad")
        return schema.names

    memo = ipc_size.SchemaMemo(walk, size=2)
    a = pa.schema([("x", pa.int32()), ("y", pa.list_(pa.string()))])
    assert memo(a) == ["x", "y"]
    assert memo(pa.schema([("x", pa.int32()), ("y", pa.list_(pa.string()))], metadata={b"k": b"v"})) == ["x", "y"]
    assert len(calls) == 1
    assert memo(pa.schema([("x", pa.int64()), ("y", pa.list_(pa.string()))])) == ["x", "y"]
    assert memo(pa.schema([("x", pa.int32()), ("z", pa.list_(pa.string()))])) == ["x", "z"]
    assert len(calls) == 3
    for _ in range(2):
        with pytest.raises(ValueError):
            memo(pa.schema([("bad", pa.int32())]))
    assert len(calls) == 5
    memo(a)  # pushed out by the last two (size=2): walked again
    assert len(calls) == 6


def test_schema_memo_that_checks_metadata_walks_a_schema_with_other_field_metadata():
    memo = ipc_size.SchemaMemo(lambda schema: schema.field("x").metadata, check_metadata=True)
    assert memo(pa.schema([pa.field("x", pa.int32(), metadata={b"k": b"1"})])) == {b"k": b"1"}
    assert memo(pa.schema([pa.field("x", pa.int32())])) is None
    assert memo(pa.schema([pa.field("x", pa.int32(), metadata={b"k": b"1"})])) == {b"k": b"1"}


def test_has_dictionary_of_equal_schemas_with_and_without_dictionaries():
    plain = pa.schema([("s", pa.list_(pa.struct([("v", pa.string())])))])
    coded = pa.schema([("s", pa.list_(pa.struct([("v", pa.dictionary(pa.int32(), pa.string()))])))])
    for _ in range(2):  # the second time from memory
        assert not ipc_size.has_dictionary(plain)
        assert ipc_size.has_dictionary(coded)


def schema_message(endianness: int | None) -> pa.ipc.Message:
    """A schema message's metadata, built by hand (pyarrow writes only this machine's
    byte order, and leaves the default, little-endian, out)."""
    meta = bytearray(44)
    struct.pack_into("<I", meta, 0, 16)  # root: the Message table
    struct.pack_into("<5H", meta, 4, 10, 12, 10, 8, 4)  # its vtable: version, header_type, header
    struct.pack_into("<iIBxh", meta, 16, 12, 36 - 20, 1, 5)  # Message: header -> 36, type Schema, V5
    if endianness is None:
        struct.pack_into("<2H", meta, 28, 4, 4)  # Schema's vtable: no fields set
    else:
        struct.pack_into("<3H", meta, 28, 6, 8, 4)  # Schema's vtable: endianness at +4
    struct.pack_into("<ih", meta, 36, 8, endianness or 0)
    return SimpleNamespace(metadata=pa.py_buffer(bytes(meta)))


def test_native_byte_order_reads_the_schemas_endianness():
    little = sys.byteorder == "little"
    assert ipc_size.native_byte_order(pa.ipc.read_message(pa.schema([("a", pa.int32())]).serialize()))
    assert ipc_size.native_byte_order(schema_message(None)) == little
    assert ipc_size.native_byte_order(schema_message(0)) == little
    assert ipc_size.native_byte_order(schema_message(1)) != little
    batch = pa.ipc.read_message(pa.record_batch({"a": [1]}).serialize())
    with pytest.raises(ValueError, match="does not start with a schema"):
        ipc_size.native_byte_order(batch)


def test_schema_message_memo_remembers_by_bytes_and_only_small_messages():
    calls = []
    memo = ipc_size.SchemaMessageMemo(lambda m: calls.append(m) or pa.ipc.read_schema(m), max_bytes=1024)
    small, other = (pa.ipc.read_message(pa.schema([(name, pa.int32())]).serialize()) for name in ("a", "b"))
    big = pa.ipc.read_message(pa.schema([("x" * 2000, pa.int32())]).serialize())
    for _ in range(2):
        assert memo(small).names == ["a"] and memo(other).names == ["b"] and memo(big).names == ["x" * 2000]
    assert calls.count(small) == 1 and calls.count(other) == 1 and calls.count(big) == 2


def test_encode_parts_measures_one_message_and_splits_the_rest_by_row_sizes():
    def decode(pieces) -> pa.Table:
        return arrow_ipc.decode(b"".join(pieces))

    small = trajectories(8, tokens=20)
    ((part, pieces),) = arrow_ipc.encode_parts(small, 1 << 20)
    assert part is small and len(pieces) == 1 and decode(pieces).equals(small)
    large = trajectories(64, tokens=4096)  # ~2.4 MB: one message, in pieces
    ((part, pieces),) = arrow_ipc.encode_parts(large, 8 << 20)
    assert part is large and len(pieces) > 1 and decode(pieces).equals(large)
    long = trajectories(40, tokens=2000)
    parts = arrow_ipc.encode_parts(long, 100_000)
    assert [p.num_rows for p, _ in parts] == [p.num_rows for p in arrow_ipc.split_rows(long, 100_000)]
    assert len(parts) > 1 and pa.concat_tables([decode(b) for _, b in parts]).equals(long)
    # Columns over one array's buffers: their total size counts them once, a reader each time.
    column = pa.array([b"x" * 1000] * 100, pa.binary())
    shared = pa.table({f"c{i}": column for i in range(20)})
    assert shared.get_total_buffer_size() < 200_000 < shared.nbytes
    parts = arrow_ipc.encode_parts(shared, 200_000)
    assert len(parts) > 1 and all(ipc_size.decoded_bytes(b"".join(b)) <= 200_000 for _, b in parts)
    compressed = arrow_ipc.encode_parts(small, 1 << 20, compress=True)
    assert len(compressed) == 1 and decode(compressed[0][1]).equals(small)
