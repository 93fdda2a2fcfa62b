"""Gathering sampled rows out of chunks.

Selections are cut into segments of consecutive picks from one chunk. A segment of
consecutive rows is one zero-copy slice. Otherwise rows of long lists (token sequences)
are sliced run by run, and rows of short ones taken with one ``take`` per segment of 16 or
more (Arrow's take of long lists builds an index per value: 16 ms for 256 rows of 36 KiB
against 4 ms sliced; for 300 B rows a take costs about ten slices). The pieces are
concatenated once: a single copy of the output. Pieces of chunks stored with shared
prompt prefixes (prefixes.py) are rebuilt into whole rows first (a copy of their
per-token columns), so callers always get the table's rows. ``Table.take`` over the chunked table
concatenates every chunk first (128 ms); measured again on pyarrow 26, one ``Table.take``
over just the chunks a sample touches is no faster anywhere: 256 random rows of 300 B
from 800 chunks 9.0 ms against 8.2 ms here, from 4 chunks 0.65 against 0.92, and of
36 KiB rows from 32 chunks 97 ms against 9 ms. Callers that do not care about order sort
their selection by (chunk, row), so that segments are long.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .prefixes import whole_rows

TAKE_BELOW_ROW_BYTES = 2048  # rows smaller than this are taken, larger ones sliced ...
TAKE_FROM_ROWS = 16          # ... when a segment has this many (a take costs ~10 slices)


def take_rows(batches: dict[int, pa.RecordBatch], chunks: np.ndarray, rows: np.ndarray,
              schema: pa.Schema) -> pa.RecordBatch:
    """Rows ``rows[i]`` of chunk ``chunks[i]``, in the given order, as one record batch."""
    n = len(chunks)
    if n == 0:
        return pa.RecordBatch.from_pylist([], schema=schema)
    # Boundaries, computed once for the whole selection: segments (a new chunk) and runs
    # (a new chunk, or a row that does not follow the previous one).
    new_chunk = np.empty(n, dtype=bool)
    new_chunk[0] = True
    np.not_equal(chunks[1:], chunks[:-1], out=new_chunk[1:])
    new_run = new_chunk.copy()
    new_run[1:] |= rows[1:] != rows[:-1] + 1
    segments = np.flatnonzero(new_chunk).tolist() + [n]
    run_starts = np.flatnonzero(new_run)
    run_bounds = np.append(run_starts, n).tolist()
    first_run = np.searchsorted(run_starts, segments[:-1]).tolist() + [len(run_starts)]
    parts = []
    for k, (start, end) in enumerate(zip(segments[:-1], segments[1:])):
        batch = batches[int(chunks[start])]
        r0, r1 = first_run[k], first_run[k + 1]  # the segment's runs
        if end - start >= TAKE_FROM_ROWS and r1 - r0 > 1 and \
                batch.get_total_buffer_size() < TAKE_BELOW_ROW_BYTES * batch.num_rows:
            parts.append(batch.take(pa.array(rows[start:end])))
        else:
            parts.extend(batch.slice(int(rows[a]), b - a) for a, b in zip(run_bounds[r0:r1], run_bounds[r0 + 1:r1 + 1]))
    parts = [whole_rows(p) for p in parts]
    return parts[0] if len(parts) == 1 else pa.concat_batches(parts)
