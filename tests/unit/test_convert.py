"""expstore_server.convert.decode_rows: untrusted IPC streams, checked whole, with the
per-schema checks done once per schema."""

from __future__ import annotations

import pyarrow as pa
import pytest

from expstore.errors import InvalidArgument
from expstore.synthetic import trajectories
from expstore_proto import arrow_ipc
from expstore_server import convert

MAX = 64 << 20


def decode(data) -> pa.Table:
    rows, nbytes = convert.decode_rows(data, table="t", message=0, row_offset=0, max_bytes=MAX)
    assert nbytes == rows.nbytes
    return rows


def test_field_names_of_one_schema_are_read_once(monkeypatch):
    walked = []
    check = convert._check_names
    monkeypatch.setattr(convert, "_check_names", lambda fields: (walked.append(fields), check(fields)))
    data = trajectories(4).append_column("only_here", pa.array([1, 2, 3, 4]))
    for i in range(3):
        assert decode(arrow_ipc.encode(data.slice(i, 1))).num_rows == 1
    assert len([f for f in walked if isinstance(f, pa.Schema)]) == 1


def test_a_name_that_is_not_utf8_is_refused_after_its_valid_twin():
    """The same schema but for one nested name's bytes is a different schema: read again."""
    good = pa.table({"s": pa.array([{"name_a": 1}])})
    assert decode(arrow_ipc.encode(good)).num_rows == 1
    stream = arrow_ipc.encode(good).to_pybytes()
    bad = stream.replace(b"name_a", b"name\xff\xfe")
    assert bad != stream
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="not a valid Arrow IPC stream"):
            decode(bad)
