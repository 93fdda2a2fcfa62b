"""Gathering sampled rows out of chunks.

Selections are cut into segments of consecutive picks from one chunk. A segment of
consecutive rows is one zero-copy slice. Otherwise rows of long lists (token sequences)
are sliced run by run, and rows of short ones taken with one ``take`` per segment of 16 or
more (Arrow's take of long lists builds an index per value: 16 ms for 256 rows of 36 KiB
against 4 ms sliced; for 300 B rows a take costs about ten slices). The pieces are
concatenated once: a single copy of the output. ``Table.take`` over the chunked table
concatenates every chunk first (128 ms). Callers that do not care about order sort
their selection by (chunk, row), so that segments are long.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

TAKE_BELOW_ROW_BYTES = 2048  # rows smaller than this are taken, larger ones sliced ...
TAKE_FROM_ROWS = 16          # ... when a segment has this many (a take costs ~10 slices)


def take_rows(batches: dict[int, pa.RecordBatch], chunks: np.ndarray, rows: np.ndarray,
              schema: pa.Schema) -> pa.RecordBatch:
    """Rows ``rows[i]`` of chunk ``chunks[i]``, in the given order, as one record batch."""
    if len(chunks) == 0:
        return pa.RecordBatch.from_pylist([], schema=schema)
    parts = []
    for start, end in _runs(np.r_[False, chunks[1:] == chunks[:-1]]):
        batch, r = batches[int(chunks[start])], rows[start:end]
        consecutive = np.r_[False, r[1:] == r[:-1] + 1]
        if end - start >= TAKE_FROM_ROWS and not consecutive[1:].all() and \
                batch.get_total_buffer_size() < TAKE_BELOW_ROW_BYTES * batch.num_rows:
            parts.append(batch.take(pa.array(r)))
        else:
            parts.extend(batch.slice(int(r[s]), e - s) for s, e in _runs(consecutive))
    return parts[0] if len(parts) == 1 else pa.concat_batches(parts)


def _runs(continues: np.ndarray):
    """(start, end) of each run; a run starts wherever ``continues`` is False."""
    starts = np.flatnonzero(~continues)
    return zip(starts.tolist(), np.append(starts[1:], len(continues)).tolist())
