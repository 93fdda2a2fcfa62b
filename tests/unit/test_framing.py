"""The hand framing of payload messages is plain protobuf on the wire, both ways."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expstore_proto import arrow_ipc, framing, service
from expstore_proto.v1 import expstore_pb2 as pb
from expstore.synthetic import trajectories

floats = st.floats(allow_nan=False)


@given(table=st.text(max_size=20), payload=st.binary(max_size=3000),
       priorities=st.lists(floats, max_size=20), timeout=floats)
def test_framed_insert_request_is_protobuf(table, payload, priorities, timeout):
    meta = pb.InsertRequest(table=table, priorities=priorities, timeout_s=timeout)
    framed = framing.encode(meta, service.INSERT_PAYLOAD, payload)
    parsed = pb.InsertRequest.FromString(framed)  # what any protobuf peer sees
    assert parsed.arrow_ipc == payload and parsed.table == table and list(parsed.priorities) == priorities
    # And our decoder reads what protobuf itself wrote.
    standard = pb.InsertRequest(table=table, arrow_ipc=payload, priorities=priorities, timeout_s=timeout)
    msg, view = service.decode_insert(standard.SerializeToString())
    assert bytes(view) == payload and msg.table == table and msg.arrow_ipc == b""


@given(ids=st.lists(st.integers(0, 2**64 - 1), max_size=50), payload=st.binary(max_size=3000))
def test_framed_rows_response_round_trip(ids, payload):
    meta = pb.RowsResponse(item_ids=ids, weights=[1.0] * len(ids))
    msg, view = service.decode_rows(framing.encode(meta, service.ROWS_PAYLOAD, payload))
    assert list(msg.item_ids) == ids and bytes(view) == payload


def test_payload_is_a_view_of_the_received_buffer():
    data = trajectories(4, tokens=64)
    framed = framing.encode(pb.RowsResponse(item_ids=[1, 2, 3, 4]), service.ROWS_PAYLOAD, arrow_ipc.encode(data))
    _, view = service.decode_rows(framed)
    assert view.obj is framed  # no copy was made
    decoded = arrow_ipc.decode(view)
    assert decoded.equals(data)
    tokens = decoded.column("tokens").chunk(0).values
    start = pa.py_buffer(framed).address
    assert start <= tokens.buffers()[1].address < start + len(framed)


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_garbage_is_a_value_error_or_a_message(data):
    try:
        service.decode_insert(data)
    except ValueError:
        pass


def test_truncated_payload_is_refused():
    framed = framing.encode(pb.InsertRequest(table="t"), service.INSERT_PAYLOAD, b"x" * 100)
    with pytest.raises(ValueError):
        service.decode_insert(framed[:-10])


def _streamed(data) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write(data)
    return sink.getvalue()


def _large_tables() -> dict[str, pa.Table | pa.RecordBatch]:
    rows = trajectories(64, tokens=4096)  # ~2.4 MB
    words = pa.array([f"word {i % 7}" for i in range(300_000)]).dictionary_encode()
    return {"one batch": rows.to_batches()[0],
            "a slice": rows.to_batches()[0].slice(3, 50),
            "chunks, one sliced": pa.concat_tables([rows, rows.slice(5, 30), rows]),
            "dictionary": pa.table({"word": words, "n": pa.array(range(300_000))})}


@pytest.mark.parametrize("name", sorted(_large_tables()))
def test_a_large_stream_comes_in_pieces_that_reference_the_rows(name):
    """Above PIECES_FROM_BYTES a stream comes as the pieces Arrow writes: together the
    bytes of a stream written into one buffer, which read back; the large ones are the
    rows' own buffers, not copies of them."""
    data = _large_tables()[name]
    assert data.get_total_buffer_size() >= arrow_ipc.PIECES_FROM_BYTES
    pieces = arrow_ipc.encode_pieces(data)
    joined = b"".join(pieces)
    assert len(pieces) > 1 and joined == _streamed(data).to_pybytes()
    table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
    assert arrow_ipc.decode(joined).equals(table)
    if name != "dictionary":  # (Arrow writes a dictionary's values from a copy)
        rows = [(b.address, b.address + b.size) for batch in table.to_batches()
                for column in batch.columns for b in column.buffers() if b is not None]
        referenced = [p for p in pieces if isinstance(p, pa.Buffer)
                      and any(start <= p.address and p.address + p.size <= end for start, end in rows)]
        assert sum(p.size for p in referenced) > 0.9 * len(joined)
