"""take_rows: the rows asked for, in the order asked, whatever mix of slices and takes
the gather chooses (short and long rows, runs, repeats, several chunks)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from expstore.gather import take_rows


def chunk(first: int, n: int, width: int) -> pa.RecordBatch:
    ids = np.arange(first, first + n, dtype=np.int64)
    values = pa.ListArray.from_arrays(np.arange(n + 1, dtype=np.int32) * width,
                                      pa.array(np.repeat(ids, width).astype(np.int32)))
    return pa.record_batch([pa.array(ids), values], names=["id", "tokens"])


@pytest.mark.parametrize("width", [1, 4096])  # rows below and above TAKE_BELOW_ROW_BYTES
def test_take_rows_returns_exactly_the_rows_asked_for_in_order(width):
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
