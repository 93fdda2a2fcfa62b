"""take_rows: the rows asked for, in the order asked, whatever mix of slices and takes
the gather chooses (short and long rows, runs, repeats, several chunks), natively and in
Python; and the native gather row for row the same as Python's, over Arrow's types."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expstore import gather
from expstore.gather import take_rows


def test_the_native_gather_is_built():
    """The install builds it (setup.py, with the dev set's C++ compiler): without it every
    sample pays the Python gather, and the tests below would check only that one."""
    assert gather.native is not None, "expstore._gather_native is missing: reinstall with a C++ compiler"


def chunk(first: int, n: int, width: int) -> pa.RecordBatch:
    ids = np.arange(first, first + n, dtype=np.int64)
    values = pa.ListArray.from_arrays(np.arange(n + 1, dtype=np.int32) * width,
                                      pa.array(np.repeat(ids, width).astype(np.int32)))
    return pa.record_batch([pa.array(ids), values], names=["id", "tokens"])


@pytest.mark.parametrize("width", [1, 4096])  # rows below and above TAKE_BELOW_ROW_BYTES
def test_take_rows_returns_exactly_the_rows_asked_for_in_order(width, gathers):
    rng = np.random.default_rng(width)
    batches = {c: chunk(1000 * c, 100, width) for c in range(5)}
    schema = batches[0].schema
    for _ in range(30):
        k = int(rng.integers(1, 200))
        chunks = np.sort(rng.integers(0, 5, k))
        rows = rng.integers(0, 100, k)
        if rng.random() < 0.5:  # runs of consecutive rows, as sorted selections have
            rows = np.concatenate([np.arange(s, min(s + 7, 100)) for s in rng.integers(0, 100, k)])[:k]
            chunks = np.sort(rng.integers(0, 5, len(rows)))
        if rng.random() < 0.3:  # in any order: a chunk may come back in several segments
            chunks = rng.permutation(chunks)
        got = take_rows(batches, chunks, rows, schema)
        want = 1000 * chunks + rows
        assert got.column("id").to_pylist() == want.tolist()
        assert [v[0] for v in got.column("tokens").to_pylist()] == want.tolist()
    assert take_rows(batches, np.zeros(0, np.int64), np.zeros(0, np.int64), schema).num_rows == 0


def test_one_run_of_one_chunk_is_a_zero_copy_slice(gathers):
    batches = {0: chunk(0, 100, 4), 1: chunk(1000, 100, 4)}
    got = take_rows(batches, np.ones(10, np.int64), np.arange(20, 30), batches[0].schema)
    assert got.column("id").to_pylist() == list(range(1020, 1030))
    ids = got.column("id")
    assert ids.offset == 20 and ids.buffers()[1].address == batches[1].column("id").buffers()[1].address


def test_the_native_gather_refuses_picks_outside_its_batches():
    b = chunk(0, 3, 2)
    with pytest.raises(IndexError, match="names batch 1 of 1"):
        gather.native.take([b], np.array([1]), np.array([0]))
    with pytest.raises(IndexError, match="names row 3 of a batch of 3"):
        gather.native.take([b], np.array([0]), np.array([3]))
    with pytest.raises(IndexError, match="names row -1"):
        gather.native.take([b], np.array([0]), np.array([-1]))


def test_chunks_of_different_schemas_are_gathered_in_python():
    a, b = chunk(0, 3, 2), pa.record_batch({"id": pa.array([7], pa.int64())})
    assert gather.native.take([a, b], np.array([0, 1]), np.array([0, 0])) is None


COLUMNS = {  # a column of each kind of Arrow layout a table may hold, with nulls
    "int": (pa.int64(), st.integers(-2**63, 2**63 - 1)),
    "float": (pa.float32(), st.floats(width=32, allow_nan=False)),
    "bool": (pa.bool_(), st.booleans()),
    "string": (pa.string(), st.text(max_size=8)),
    "large_binary": (pa.large_binary(), st.binary(max_size=8)),
    "tokens": (pa.list_(pa.int32()), st.lists(st.integers(0, 2**31 - 1), max_size=6)),
    "logprobs": (pa.large_list(pa.float32()), st.lists(st.floats(width=32, allow_nan=False), max_size=4)),
    "pair": (pa.list_(pa.int8(), 2), st.lists(st.integers(-128, 127), min_size=2, max_size=2)),
    "turn": (pa.struct([("role", pa.string()), ("ids", pa.list_(pa.int16()))]),
             st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"]),
                                    "ids": st.lists(st.integers(0, 99), max_size=3)})),
    "tool": (pa.dictionary(pa.int32(), pa.string()), st.sampled_from(["search", "python", "shell"])),
}


@st.composite
def selections(draw):
    names = draw(st.lists(st.sampled_from(sorted(COLUMNS)), min_size=1, max_size=4, unique=True))
    schema = pa.schema([(n, COLUMNS[n][0]) for n in names])
    batches = {}
    for k in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 12))
        columns = [pa.array(draw(st.lists(st.one_of(st.none(), COLUMNS[name][1]), min_size=n, max_size=n)),
                            COLUMNS[name][0]) for name in names]
        batch = pa.RecordBatch.from_arrays(columns, schema=schema)
        skip = draw(st.integers(0, n - 1))
        batches[3 * k + 1] = batch.slice(skip)  # a chunk may be a slice of a larger batch
    keys = sorted(batches)
    picks = draw(st.lists(st.sampled_from([(c, r) for c in keys for r in range(batches[c].num_rows)]),
                          min_size=1, max_size=30))
    chunks, rows = (np.array(v, np.int64) for v in zip(*picks))
    return batches, chunks, rows, schema


@settings(max_examples=150, deadline=None)
@given(selections())
def test_the_native_gather_is_the_python_gather(selection):
    batches, chunks, rows, schema = selection
    keys = np.unique(chunks)
    native = gather.native.take([batches[k] for k in keys.tolist()], np.searchsorted(keys, chunks), rows)
    python = pa.concat_batches([batches[int(c)].slice(int(r), 1) for c, r in zip(chunks, rows)])
    if native is None:  # a type Arrow cannot append slices of: take_rows gathers in Python
        return
    native.validate(full=True)
    assert native.schema.equals(schema) and native.to_pylist() == python.to_pylist()
