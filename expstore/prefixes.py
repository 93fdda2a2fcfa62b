"""Shared prompt prefixes: the rows of a chunk store each distinct prompt once.

The members of a GRPO group (and any rows sent for the same prompt) repeat the prompt's
tokens, and with them the prompt's part of every per-token column: a group of 16 with a
2,048-token prompt and 512-token answers is 80% prompt. A chunk stores them once:

    stored column  tokens: struct<prefix: list_view<int32>, rest: list<int32>>
                             prefix ── offset, size ──> one buffer of the chunk's distinct prompts
                             rest   ── the row's tokens after its prompt (a copy of its own)

The prompt of a row is the tokens before its first ``loss_mask`` 1 (its whole length if
none: ``prompt_lengths``), the same cut the ``group_prefix`` ingest check compares. Every
per-token column (``PER_TOKEN``: tokens, loss_mask, logprobs, ...) is split at that length
and its prefixes are content-addressed on their own: rows share a prefix exactly when its
bytes are equal (a dict keyed by the bytes themselves, so equality is exact, not a hash
match), whatever their group or prompt_id. So the prompt's loss_mask zeros and its
logprobs (zeros, as engines report none for the prompt) are shared too, and rows whose
prompts differ simply keep their own. Only a chunk whose rows share a prompt's tokens is
stored so (the zero loss_mask and logprobs of distinct prompts alone saved little and
made every sample of 300 B rows rebuild them: half the rate). A column is left as it is
(a plain list) where sharing would save less than MIN_SAVED_BYTES or MIN_SAVED_SHARE,
where its values hold nulls, in chunks whose prompts average under MIN_PROMPT_TOKENS, and
in chunks without ``tokens`` and ``loss_mask``; a null row stays null.

``share`` turns a batch of whole rows into its stored form (the placement calls it as a
chunk is written: the memory tier holds it, the SSD tier's blocks are encoded from it),
``whole_rows`` turns any slice or take of a stored batch back into exactly the rows that
were shared (``gather.take_rows`` rebuilds every row it copies so, natively where the
native gather is built: samples, streams, scans, compactions and the archive see whole
rows; a batch of whole rows, e.g. a chunk written before this existed or read from the
remote tier, passes through untouched), and
``compact`` keeps a slice's prefix buffer to the prompts its rows use (an IPC message of a
sliced list view carries every value from its lowest offset to its highest end: an SSD
block whose rows use a chunk's first and last prompts would store all of them). Stored
columns are marked by field metadata (``MARK``, ``is_marked``), so that a user's struct
column is never mistaken for one. Pure functions: thread-safe.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from expstore_proto.ipc_size import SchemaMemo

try:  # after pyarrow, which has loaded the libarrow the module links to
    from . import _gather_native as native
except ImportError:  # not built: no C++ compiler at install (setup.py)
    native = None

MARK = b"expstore.shared_prefix"
PER_TOKEN = ("tokens", "loss_mask", "logprobs", "token_policy_version", "advantages", "values")
"""Columns with one value per token (validation keeps their lengths equal to tokens')."""
COPY_BY_INDEX_BELOW = 128  # rows shorter than this (on average) are gathered through an index
"""Longer ones are copied as slices (memcpys): an index per value cost ~10x more, 28 ms
against 3 ms for a 256-row sample of 2,560-token rows."""
MIN_SAVED_BYTES = 4096
MIN_SAVED_SHARE = 0.1
"""A column is shared only where that saves this much in its chunk, and this share of the
column's bytes: below it, the larger schema every SSD chunk keeps, the copy that splits
the column and the copy that rebuilds its rows are not worth it (256 rows of 4,096 tokens
with 8-token prompts: sharing their logprobs' zeros saved 0.2% and made the durable insert
2.4x and the sample 1.5x slower)."""
MIN_PROMPT_TOKENS = 64
"""Rows whose prompts are shorter than this on average are stored as sent: each saves
little (under 256 B a column) while every read rebuilds it at a fixed cost per piece. 300 B
rows (20 tokens, 8 of them prompt) repeated across a compacted chunk saved 13% of their
bytes and made a 256-row sample 1.9x slower (4.5 -> 8.8 ms, 99 chunks)."""


def share(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with each per-token column's distinct prompt prefixes stored once (the
    same batch when nothing would be saved). O(rows + values); one copy of the answers."""
    names = batch.schema.names
    if "tokens" not in names or "loss_mask" not in names:
        return batch
    loss_mask = batch.column("loss_mask")
    starts, ends = _bounds(loss_mask)
    tokens = int((ends - starts).sum())
    if tokens < MIN_PROMPT_TOKENS * len(starts):  # prompts are never longer than their rows
        return batch  # short rows (an agent's turns, 300 B rows): skips ~60 us of numpy a chunk
    prompt = prompt_lengths(loss_mask)
    if prompt is None or int(prompt.sum()) < max(MIN_SAVED_SHARE * tokens, MIN_PROMPT_TOKENS * len(prompt)):
        return batch  # no column could save enough: not worth looking at each
    fields, columns = list(batch.schema), list(batch.columns)
    order = sorted(range(len(fields)), key=lambda i: fields[i].name != "tokens")  # tokens first
    for i in order:
        f = fields[i]
        if f.name in PER_TOKEN and _splittable(f.type):
            stored = _share_column(columns[i], prompt)
            if stored is None and f.name == "tokens":
                return batch  # no two rows share a prompt: their zeros alone are not worth a rebuild
            if stored is not None:
                columns[i] = stored
                fields[i] = pa.field(f.name, stored.type, f.nullable, {**(f.metadata or {}), MARK: b"1"})
    return pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields, batch.schema.metadata))


def is_shared(schema: pa.Schema) -> bool:
    """Whether a batch of this schema has a column stored with shared prefixes."""
    return bool(marked_names(schema))


def marked_names(schema: pa.Schema) -> frozenset[str]:
    """The columns of a batch of this schema stored with shared prefixes. Asked of every
    chunk a sample touches (hundreds): answered from memory for a schema seen lately
    (walking the fields cost 1.2 ms a sample of 300 B rows from 220 chunks)."""
    return _marked_names(schema)


_marked_names = SchemaMemo(lambda schema: frozenset(f.name for f in schema if is_marked(f)), check_metadata=True)


def is_marked(field: pa.Field) -> bool:
    """Whether a stored column holds shared prefixes (``struct<prefix, rest>``)."""
    return bool(field.metadata) and MARK in field.metadata


def whole_field(field: pa.Field, whole: pa.DataType) -> pa.Field:
    """The field of a marked column once rebuilt as ``whole``: the user's metadata, not ours."""
    meta = {k: v for k, v in field.metadata.items() if k != MARK}
    return pa.field(field.name, whole, field.nullable, meta or None)


def whole_type(stored: pa.DataType) -> pa.DataType:
    """The list type of a column stored as ``stored`` (itself unless a struct<prefix, rest>)."""
    return stored.field(1).type if pa.types.is_struct(stored) else stored


def whole_schema(schema: pa.Schema) -> pa.Schema:
    """The schema of a stored batch's whole rows (``whole_rows``): the table's own. Asked
    of every chunk a sample touches: answered from memory for a schema seen lately."""
    return _whole_schema(schema)


_whole_schema = SchemaMemo(lambda schema: pa.schema(
    [whole_field(f, whole_type(f.type)) if is_marked(f) else f for f in schema], schema.metadata),
    check_metadata=True)


def whole_rows(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The whole rows of a stored batch (or slice, or take of one): each marked column
    rebuilt as its original list (a copy); other columns are the batch's own."""
    if not is_shared(batch.schema):
        return batch
    fields, columns = list(batch.schema), list(batch.columns)
    for i, f in enumerate(fields):
        if is_marked(f):
            columns[i] = _whole_column(columns[i])
            fields[i] = whole_field(f, columns[i].type)
    return pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields, batch.schema.metadata))


def take_whole(pieces: list[tuple[pa.Array, np.ndarray]]) -> pa.ListArray:
    """Rows ``rows`` of each column ``column`` of ``pieces``, in order, as one whole
    column: the gather of a sample, copied once, straight from the chunks' buffers. A
    column is a stored one (``struct<prefix, rest>``) or, from a chunk that shares no
    prompt, the list itself (all answer, no prompt)."""
    parts = [_piece(column, rows) for column, rows in pieces]
    lengths = np.concatenate([p_len + r_len for _, _, p_len, _, _, r_len, _ in parts])
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    list_type = whole_type(pieces[0][0].type)
    out = np.empty(int(offsets[-1]), dtype=parts[0][3].dtype)
    if len(lengths) * COPY_BY_INDEX_BELOW > len(out):  # short rows: gather through an index
        row = 0
        for p_values, p_at, p_len, r_values, r_at, r_len, _ in parts:
            to = offsets[row:row + len(p_at)]
            out[_ranges(to, p_len)] = p_values[_ranges(p_at, p_len)]
            out[_ranges(to + p_len, r_len)] = r_values[_ranges(r_at, r_len)]
            row += len(p_at)
    else:  # long rows: one concatenation of views of their pieces (memcpys)
        views = []
        for p_values, p_at, p_len, r_values, r_at, r_len, _ in parts:
            for a, k, b, m in zip(p_at.tolist(), p_len.tolist(), r_at.tolist(), r_len.tolist()):
                views += (p_values[a:a + k], r_values[b:b + m])
        if views:
            np.concatenate(views, out=out)
    valid = np.concatenate([v for *_, v in parts])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(out, list_type.value_type),
                                    type=list_type, mask=None if valid.all() else pa.array(~valid))


def compact(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A slice of a stored batch whose prefix buffers hold only the prompts its rows use
    (what to serialize it from); other batches as they are."""
    if not is_shared(batch.schema):
        return batch
    columns = list(batch.columns)
    for i, f in enumerate(batch.schema):
        if is_marked(f):
            s = columns[i]
            prefix = s.field(0)
            offsets, sizes = _np(prefix.offsets), _np(prefix.sizes)
            used = np.flatnonzero(sizes)
            starts, first = np.unique(offsets[used], return_index=True)
            lengths = sizes[used][first]
            kept = _np(prefix.values)[_ranges(starts, lengths)]
            new_starts = np.zeros(len(starts), np.int64)
            np.cumsum(lengths[:-1], out=new_starts[1:])
            new_offsets = np.zeros(len(offsets), np.int64)
            new_offsets[used] = new_starts[np.searchsorted(starts, offsets[used])]
            prefix = pa.ListViewArray.from_arrays(pa.array(new_offsets, pa.int32()), pa.array(sizes, pa.int32()),
                                                  pa.array(kept, prefix.type.value_type), type=prefix.type)
            columns[i] = pa.StructArray.from_arrays([prefix, s.field(1)], fields=list(s.type),
                                                    mask=_null_mask(s))
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def prompt_lengths(loss_mask: pa.Array) -> np.ndarray | None:
    """Tokens before each row's first loss_mask 1 (its length if none; 0 for a null row);
    None if the mask's values hold nulls."""
    if loss_mask.values.null_count:
        return None
    starts, ends = _bounds(loss_mask)
    out = first_ones(_np(loss_mask.values), starts, ends)
    out[~_valid(loss_mask)] = 0
    return out


def first_ones(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """For each row [starts[i], ends[i]) of ``values``, how many values come before its
    first 1 (its length if none). Natively where the gather is built, for one-byte values
    (loss_mask's uint8; int8, bool): a scan that stops at each row's first 1, where numpy
    reads every value (256 rows of 4,096 tokens with 8-token prompts: ~0.7 ms, on every
    durable insert, against 0.01)."""
    if native is not None and values.dtype.itemsize == 1:  # the byte 1 is the value 1
        return native.prompt_lengths(values.view(np.uint8), starts, ends)
    one = values == 1
    rises = np.flatnonzero(one[1:] & ~one[:-1]) + 1  # where runs of 1s begin: few, one per generated turn
    at = np.append(rises, ends[-1] if len(ends) else 0)[np.searchsorted(rises, starts)]
    begins_with_one = np.zeros(len(starts), bool)
    nonempty = np.flatnonzero(ends > starts)
    begins_with_one[nonempty] = one[starts[nonempty]]
    at[begins_with_one] = starts[begins_with_one]
    return np.minimum(at, ends) - starts


# -- internals ----------------------------------------------------------------------------

def _splittable(t: pa.DataType) -> bool:
    """A list of fixed-width numbers (their bytes are their content)."""
    return pa.types.is_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type))


def _share_column(column: pa.ListArray, prompt: np.ndarray) -> pa.StructArray | None:
    """The stored form of one per-token column, or None where it would not save bytes."""
    if column.values.null_count:
        return None
    values = _np(column.values)
    starts, ends = _bounds(column)
    valid = _valid(column)
    cut = np.where(valid, np.minimum(prompt, ends - starts), 0)
    ref, firsts = _distinct(values, starts, cut)
    lengths = cut[firsts]
    saved = (int(cut.sum()) - int(lengths.sum())) * values.itemsize
    total = int((ends - starts)[valid].sum()) * values.itemsize
    if saved < max(MIN_SAVED_BYTES, 8 * len(cut), MIN_SAVED_SHARE * total):  # a list view: an offset and a size per row
        return None
    distinct_at = np.zeros(len(firsts), np.int64)
    np.cumsum(lengths[:-1], out=distinct_at[1:])
    prefix_values = values[_ranges(starts[firsts], lengths)]
    view_type = pa.list_view(column.type.value_field)
    prefix = pa.ListViewArray.from_arrays(pa.array(np.where(cut > 0, distinct_at[ref], 0), pa.int32()),
                                          pa.array(cut, pa.int32()), pa.array(prefix_values, column.type.value_type),
                                          type=view_type)
    rest_lengths = np.where(valid, ends - starts - cut, 0)
    rest_offsets = np.zeros(len(cut) + 1, np.int64)
    np.cumsum(rest_lengths, out=rest_offsets[1:])
    rest_values = values[_ranges(starts + cut, rest_lengths)]
    mask = None if valid.all() else pa.array(~valid)
    rest = pa.ListArray.from_arrays(pa.array(rest_offsets, pa.int32()), pa.array(rest_values, column.type.value_type),
                                    type=column.type, mask=mask)
    return pa.StructArray.from_arrays([prefix, rest], fields=[pa.field("prefix", view_type), pa.field("rest", column.type)],
                                      mask=mask)


def _distinct(values: np.ndarray, starts: np.ndarray, cut: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows' prefixes ``values[starts[r]:starts[r] + cut[r]]``: each row's index among
    the distinct ones (0 for an empty prefix), and the first row holding each. A dict keyed
    by the prefixes' bytes, read through one view of the values: slicing the array and
    indexing numpy scalars row by row made ``share`` of 256 rows of 2,560 tokens (16 groups)
    6.1 ms instead of 5.4."""
    raw = memoryview(np.ascontiguousarray(values)).cast("B")
    size = values.itemsize
    ids: dict[bytes, int] = {}  # prefix bytes -> its index among the distinct ones
    ref = np.zeros(len(cut), np.int64)
    rows = np.flatnonzero(cut)
    at, n = (starts[rows] * size).tolist(), (cut[rows] * size).tolist()
    refs = [ids.setdefault(bytes(raw[a:a + k]), len(ids)) for a, k in zip(at, n)]
    ref[rows] = refs
    _, first = np.unique(np.asarray(refs, np.int64), return_index=True)  # ids count up from 0
    return ref, rows[first]


def _piece(column: pa.Array, rows: np.ndarray) -> tuple:
    """Where rows ``rows`` of a column lie: (prompt values, each row's prompt start and
    length, answer values, each row's answer start and length, validity)."""
    valid = _valid(column)[rows]
    rest = column.field(1) if pa.types.is_struct(column.type) else column
    r_values, (r_at, r_end) = _np(rest.values), _bounds(rest)
    if rest is column:  # a column stored whole: no prompt
        none = np.zeros(len(rows), np.int64)
        p_values, p_at, p_len = r_values[:0], none, none
    else:
        prefix = column.field(0)
        p_values, p_at, p_len = _np(prefix.values), _np(prefix.offsets)[rows], np.where(valid, _np(prefix.sizes)[rows], 0)
    return p_values, p_at, p_len, r_values, r_at[rows], np.where(valid, r_end[rows] - r_at[rows], 0), valid


def _whole_column(stored: pa.StructArray) -> pa.ListArray:
    return take_whole([(stored, np.arange(len(stored)))])


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices ``starts[i] .. starts[i] + lengths[i]``, concatenated."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, np.int64) - (ends - lengths), lengths)


def _bounds(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's [start, end) in ``column.values`` (a slice's offsets do not start at 0)."""
    offsets = _np(column.offsets).astype(np.int64)
    return offsets[:-1], offsets[1:]


def _valid(column: pa.Array) -> np.ndarray:
    if column.null_count == 0:
        return np.ones(len(column), bool)
    return column.is_valid().to_numpy(zero_copy_only=False)


def _null_mask(column: pa.Array) -> pa.Array | None:
    return None if column.null_count == 0 else column.is_null()


def _np(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False)
