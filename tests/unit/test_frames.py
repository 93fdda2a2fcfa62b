"""The server's RowsResponse messages: the rows' IPC stream byte for byte as Arrow writes
it, whole or joined from its pieces, for record batches and tables of Arrow's types
(dictionaries, nulls, slices, several chunks, no rows); any protobuf peer reads them."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from expstore.synthetic import trajectories
from expstore_proto import arrow_ipc, framing, service
from expstore_proto.v1 import expstore_pb2 as pb
from expstore_server import frames


def one_buffer_message(meta: pb.RowsResponse, data) -> bytes:
    return framing.encode(meta, service.ROWS_PAYLOAD, arrow_ipc.encode(data))


COLUMNS = {
    "id": (pa.int64(), st.integers(-2**63, 2**63 - 1)),
    "reward": (pa.float32(), st.floats(width=32, allow_nan=False)),
    "text": (pa.string(), st.text(max_size=8)),
    "tokens": (pa.list_(pa.int32()), st.lists(st.integers(0, 2**31 - 1), max_size=6)),
    "turn": (pa.struct([("role", pa.string()), ("ids", pa.list_(pa.int16()))]),
             st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"]),
                                    "ids": st.lists(st.integers(0, 99), max_size=3)})),
    "tool": (pa.dictionary(pa.int32(), pa.string()), st.sampled_from(["search", "python"])),
}


@st.composite
def rows(draw):
    names = draw(st.lists(st.sampled_from(sorted(COLUMNS)), min_size=1, max_size=4, unique=True))
    schema = pa.schema([(n, COLUMNS[n][0]) for n in names], metadata={"expstore": "test"})
    n = draw(st.integers(0, 12))
    batch = pa.RecordBatch.from_arrays(
        [pa.array(draw(st.lists(st.one_of(st.none(), COLUMNS[c][1]), min_size=n, max_size=n)), COLUMNS[c][0])
         for c in names], schema=schema)
    skip = draw(st.integers(0, n))
    data = batch.slice(skip)
    if draw(st.booleans()):  # a table of several chunks
        cut = draw(st.integers(0, data.num_rows))
        data = pa.Table.from_batches([data.slice(0, cut), data.slice(cut)], schema=schema)
    return data


@settings(max_examples=150, deadline=None)
@given(data=rows(), ids=st.lists(st.integers(0, 2**64 - 1), max_size=5))
def test_a_message_of_pieces_is_the_one_buffer_message(data, ids):
    meta = pb.RowsResponse(item_ids=ids, priorities=[0.5] * len(ids))
    message = framing.encode(meta, service.ROWS_PAYLOAD, *arrow_ipc.stream_pieces(data))
    assert message == one_buffer_message(meta, data) == frames.rows_message(meta, data)
    parsed = pb.RowsResponse.FromString(message)  # what any protobuf peer sees
    assert list(parsed.item_ids) == ids
    assert arrow_ipc.decode(parsed.arrow_ipc).equals(pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch)
                                                     else data)


def test_a_large_message_is_the_one_buffer_message():
    """Rows over arrow_ipc.PIECES_FROM_BYTES, joined from their pieces; and a payload
    whose length takes a 4-byte varint."""
    data = trajectories(256, tokens=4096)
    assert data.get_total_buffer_size() > arrow_ipc.PIECES_FROM_BYTES
    meta = pb.RowsResponse(item_ids=range(256))
    assert frames.rows_message(meta, data) == one_buffer_message(meta, data)


def test_compressed_rows_are_one_buffer():
    data = trajectories(8, tokens=512)
    message = frames.rows_message(pb.RowsResponse(), data, compress=True)
    _, view = service.decode_rows(message)
    assert arrow_ipc.decode(view).equals(data) and len(message) < len(one_buffer_message(pb.RowsResponse(), data))
