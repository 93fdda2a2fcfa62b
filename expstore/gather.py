"""Gathering sampled rows out of chunks.

Selections are cut into segments of consecutive picks from one chunk. A segment of
consecutive rows is one zero-copy slice. Otherwise rows of long lists (token sequences)
are sliced run by run, and rows of short ones taken with one ``take`` per segment of 16 or
more (Arrow's take of long lists builds an index per value: 16 ms for 256 rows of 36 KiB
against 4 ms sliced; for 300 B rows a take costs about ten slices). The pieces are
concatenated once: a single copy of the output. From chunks stored with shared prompt
prefixes (prefixes.py), the other columns are gathered so, and each shared column is
copied once, row by row, from the chunks' prompt and answer buffers into whole rows
(``prefixes.take_whole``; rebuilding each slice instead cost ~1 ms of fixed overheads a
piece: a 256-row sample of 2,560-token rows took 25x longer), so callers always get the
table's rows. From many small batches (a cold sample reads ~200 SSD blocks of ~11 such
rows) the shared columns are concatenated first and rebuilt as one piece: the per-piece
overheads cost more than copying the blocks' few prompts. ``Table.take`` over the chunked table
concatenates every chunk first (128 ms); measured again on pyarrow 26, one ``Table.take``
over just the chunks a sample touches is no faster anywhere: 256 random rows of 300 B
from 800 chunks 9.0 ms against 8.2 ms here, from 4 chunks 0.65 against 0.92, and of
36 KiB rows from 32 chunks 97 ms against 9 ms. Callers that do not care about order sort
their selection by (chunk, row), so that segments are long.

Where it is built (setup.py), the native gather (gather_native.cpp) does all of that in
one call: Arrow's builders copy each run of rows straight into the output, column by
column, with the GIL released, and rebuild the rows of columns stored with shared prefixes
whole as they copy them (list and string builders reserve their values' room first).
Measured on this machine class, 256 random rows: 300 B rows from 800 chunks 0.27 ms
against 2.2 ms here, from 4 chunks 0.07 against 0.34, 36 KiB rows from 32 chunks 0.48
against 2.8. A selection that is one run of one plain chunk stays a zero-copy slice;
types whose builders cannot append slices are gathered here. So is a selection of long
runs (compaction merging whole chunks, a stream reading rows in order):
Arrow's Concatenate of the runs' slices copies each column's buffers whole, where the
builders append row by row. Measured, 4,096 rows of 300 B in runs of 256: 0.22 ms
against 0.58 native; in runs of 64-128 both cost about the same (300 B and 36 KiB rows);
in runs of 16, native is faster (0.66 against 2.5 ms).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .prefixes import is_shared, marked_names, take_whole, whole_rows, whole_schema

try:  # after pyarrow, which has loaded the libarrow the module links to
    from . import _gather_native as native
except ImportError:  # not built: no C++ compiler at install (setup.py)
    native = None

TAKE_BELOW_ROW_BYTES = 2048  # rows smaller than this are taken, larger ones sliced ...
TAKE_FROM_ROWS = 16          # ... when a segment has this many (a take costs ~10 slices)
CONCAT_FROM_PIECES = 8       # shared columns of more pieces than this are concatenated first ...
CONCAT_BELOW_ROWS_PER_ROW = 8  # ... when their batches hold under this many rows per row taken
SLICE_FROM_RUN_ROWS = 128  # plain selections whose runs average this many rows are sliced, not gathered natively


def take_rows(batches: dict[int, pa.RecordBatch], chunks: np.ndarray, rows: np.ndarray,
              schema: pa.Schema) -> pa.RecordBatch:
    """Rows ``rows[i]`` of chunk ``chunks[i]``, in the given order, as one record batch."""
    n = len(chunks)
    if n == 0:
        return pa.RecordBatch.from_pylist([], schema=schema)
    keys, positions = np.unique(chunks, return_inverse=True)  # positions: of each pick's chunk in keys
    used = [batches[c] for c in keys.tolist()]
    mixed = any(is_shared(b.schema) for b in used)  # chunks stored with shared prefixes
    whole = None
    if mixed:
        whole = whole_schema(used[0].schema)
        if not all(whole_schema(b.schema).equals(whole, check_metadata=True) for b in used):
            whole = None  # chunks of different tables' schemas (rare): each piece rebuilt below
    # Boundaries, computed once for the whole selection: segments (a new chunk) and runs
    # (a new chunk, or a row that does not follow the previous one).
    new_chunk = np.empty(n, dtype=bool)
    new_chunk[0] = True
    np.not_equal(chunks[1:], chunks[:-1], out=new_chunk[1:])
    new_run = new_chunk.copy()
    new_run[1:] |= rows[1:] != rows[:-1] + 1
    runs = np.count_nonzero(new_run)
    if native is not None and (whole is not None or 1 < runs and n < runs * SLICE_FROM_RUN_ROWS):  # else: slices
        out = native.take(used, positions, rows, whole)
        if out is not None:
            return out
    if whole is not None:
        return _take_shared(batches, used, chunks, rows, whole)
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
    if mixed:  # chunks of different tables' schemas (rare): rebuild each piece
        parts = [whole_rows(p) for p in parts]
    return parts[0] if len(parts) == 1 else pa.concat_batches(parts)


def _take_shared(batches: dict[int, pa.RecordBatch], used: list[pa.RecordBatch], chunks: np.ndarray,
                 rows: np.ndarray, whole: pa.Schema) -> pa.RecordBatch:
    """``take_rows`` of chunks whose rows have schema ``whole``, some stored with shared
    prefixes and some maybe not (a chunk whose rows share no prompt is stored as sent): the
    other columns as ``take_rows`` gathers them, each column shared in any chunk rebuilt by
    ``prefixes.take_whole`` from every chunk's form of it."""
    shared = sorted(frozenset().union(*(marked_names(b.schema) for b in used)))
    others = take_rows({k: b.drop_columns(shared) for k, b in batches.items()}, chunks, rows,
                       pa.schema([f for f in whole if f.name not in shared]))
    starts = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1]]).tolist() + [len(chunks)]
    keys = np.unique(chunks)
    sizes = np.array([batches[k].num_rows for k in keys.tolist()], np.int64)
    one_form = all(b.schema.equals(used[0].schema, check_metadata=True) for b in used)
    if one_form and len(starts) > CONCAT_FROM_PIECES and sizes.sum() <= CONCAT_BELOW_ROWS_PER_ROW * len(chunks):
        # many small batches (SSD blocks): one piece over their concatenation
        first = np.zeros(len(keys), np.int64)
        np.cumsum(sizes[:-1], out=first[1:])
        at = first[np.searchsorted(keys, chunks)] + rows
        columns = {name: take_whole([(pa.concat_arrays([batches[k].column(name) for k in keys.tolist()]), at)])
                   for name in shared}
    else:
        columns = {name: take_whole([(batches[int(chunks[a])].column(name), rows[a:b])
                                     for a, b in zip(starts[:-1], starts[1:])]) for name in shared}
    return pa.RecordBatch.from_arrays([columns[f.name] if f.name in columns else others.column(f.name)
                                       for f in whole], schema=whole)
