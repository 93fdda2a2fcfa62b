"""expstore_server.convert.decode_rows: untrusted IPC streams, checked whole, with the
per-schema checks done once per schema."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest

from expstore.errors import InvalidArgument
from expstore.synthetic import trajectories
from expstore_proto import arrow_ipc, ipc_size
from expstore_server import convert

MAX = 64 << 20


def decode_rows_of(data) -> pa.Table:
    rows, nbytes = convert.decode_rows(data, table="t", message=0, row_offset=0, max_bytes=MAX)
    assert nbytes >= rows.nbytes
    return rows


def test_field_names_of_one_schema_are_read_once(monkeypatch):
    walked = []
    check = convert._check_names
    monkeypatch.setattr(convert, "_check_names", lambda fields: (walked.append(fields), check(fields)))
    data = trajectories(4).append_column("only_here", pa.array([1, 2, 3, 4]))
    for i in range(3):
        assert decode_rows_of(arrow_ipc.encode(data.slice(i, 1))).num_rows == 1
    assert len([f for f in walked if isinstance(f, pa.Schema)]) == 1


def test_a_name_that_is_not_utf8_is_refused_after_its_valid_twin():
    """The same schema but for one nested name's bytes is a different schema: read again."""
    good = pa.table({"s": pa.array([{"name_a": 1}])})
    assert decode_rows_of(arrow_ipc.encode(good)).num_rows == 1
    stream = arrow_ipc.encode(good).to_pybytes()
    bad = stream.replace(b"name_a", b"name\xff\xfe")
    assert bad != stream
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="not a valid Arrow IPC stream"):
            decode_rows_of(bad)


def overlapping_columns(columns: int, rows: int, width: int) -> bytes:
    """An uncompressed stream of ``columns`` binary columns whose buffers all lie over the
    first column's: one column's bytes on the wire, ``columns`` times that once read (and
    once copied, as inserts are when committed together)."""
    col = pa.array([b"x" * width] * rows, pa.binary())
    stream = arrow_ipc.encode(pa.table({f"c{i}": col for i in range(columns)})).to_pybytes()
    offsets, data = 4 * (rows + 1), width * rows
    stride = (offsets + 7) // 8 * 8 + data  # buffers are 8-byte aligned; data is a multiple of 8
    for i in range(1, columns):
        for old, new in [((i * stride, offsets), (0, offsets)), ((i * stride + stride - data, data), (stride - data, data))]:
            assert stream.count(struct.pack("<qq", *old)) == 1
            stream = stream.replace(struct.pack("<qq", *old), struct.pack("<qq", *new))
    body = struct.pack("<q", columns * stride)  # Message.bodyLength
    assert stream.count(body) == 1
    stream = stream.replace(body, struct.pack("<q", stride))
    eos = 8
    return stream[:len(stream) - eos - (columns - 1) * stride]


def test_buffers_that_overlap_count_as_often_as_columns_read_them():
    """Without compression a stream cannot inflate, but buffers can share bytes: each
    column is read (and copied, once stored) at its full size."""
    stream = overlapping_columns(columns=100, rows=1000, width=64)
    assert len(stream) < 100_000 and arrow_ipc.decode(stream).nbytes == 100 * 1000 * (64 + 4)
    with pytest.raises(InvalidArgument, match=r"its rows would take 68\d{5} bytes decompressed, more than "
                                              r"max_message_bytes \(1048576\)"):
        convert.decode_rows(stream, table="t", message=0, row_offset=0, max_bytes=1 << 20)
    rows, nbytes = convert.decode_rows(stream, table="t", message=0, row_offset=0, max_bytes=8 << 20)
    assert rows.num_rows == 1000 and nbytes >= rows.nbytes


@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
def test_rows_come_back_as_sent_from_every_kind_of_stream(compression):
    """Record batches are read from the messages framed for the size check (several
    batches, compressed or not); a stream with dictionaries by Arrow's stream reader."""
    data = pa.concat_tables([trajectories(3, id_prefix="a"), trajectories(2, id_prefix="b")])
    coded = data.append_column("code", pa.array(["x", "y", "x", "x", "y"]).dictionary_encode())
    for sent in (data, coded):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, sent.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
            w.write(sent)
        rows, nbytes = convert.decode_rows(sink.getvalue(), table="t", message=0, row_offset=0, max_bytes=MAX)
        assert rows.equals(sent) and rows.num_rows == 5 and len(rows.to_batches()) == 2
        assert nbytes >= rows.nbytes


def test_a_stream_in_the_other_byte_order_is_read_by_arrows_reader(monkeypatch):
    """``pa.ipc.read_record_batch`` would not swap its bytes; Arrow's stream reader does."""
    read = []
    decode = arrow_ipc.decode
    monkeypatch.setattr(ipc_size, "native_byte_order", lambda message: False)
    monkeypatch.setattr(arrow_ipc, "decode", lambda data: (read.append(data), decode(data))[1])
    data = pa.table({"other_order": [1, 2, 3]})
    assert decode_rows_of(arrow_ipc.encode(data)).equals(data) and len(read) == 1


def test_a_stream_that_does_not_start_with_a_schema_is_refused_as_such():
    batch = pa.record_batch({"a": [1]}).serialize().to_pybytes() + b"\xff\xff\xff\xff\x00\x00\x00\x00"
    with pytest.raises(InvalidArgument, match="insert message 0: not a valid Arrow IPC stream: the stream "
                                              "starts with a record batch message, not a schema"):
        decode_rows_of(batch)
