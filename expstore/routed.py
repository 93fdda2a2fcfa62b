"""The ``routed_experts`` column: per-token routed expert ids of an MoE policy (R3).

Router replay (R3) trains an MoE policy with the experts its rollout engine routed each
token to, so that training and inference agree on the sparse path. A table declares the
model's shape (``TableSpec.routed_experts``: layers, top_k, num_experts) and gets the
column ``routed_experts: list<fixed_size_list<fixed_size_list<uint8 | uint16, top_k>,
layers>>``: one entry per token (prompt tokens included: the engine routes them in
prefill), ``layers * top_k`` ids of the narrowest type, no offsets below the token
level. A row may leave it null (nothing recorded); the SSD tier compresses the chunks
like any other column.

:func:`check` runs on what a client sent, *before* it is cast to the column's type, so
that an id out of range or an entry of the wrong shape is reported with its row, token
and layer rather than as a failed cast. It accepts any nesting of lists, large lists and
fixed-size lists of integers. Vectorised: list lengths and one comparison over the flat
ids; locations are computed for the first offence only (the ids of a 256-row insert of
long rollouts number in the hundreds of millions).

Bytes per token: ``layers * top_k * itemsize`` raw (64 layers, top-8 of 256 experts:
512 B), plus 4 bytes of list offsets per row. Stored (zstd) sizes are measured by
benchmarks/routed_experts.py and reported in docs/semantics.md.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import InvalidArgument
from .spec import RoutedExpertsSpec

COLUMN = "routed_experts"


def check(column: pa.ChunkedArray | pa.Array, token_counts: np.ndarray, spec: RoutedExpertsSpec, *,
          table: str, row_offset: int = 0) -> None:
    """Raise InvalidArgument naming the first row whose entry does not fit ``spec``:
    where set, one entry per token (``token_counts[row]``), each ``layers`` lists of
    ``top_k`` integer ids in [0, num_experts), no nulls inside."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column

    def fail(j: int, level: int, what: str) -> InvalidArgument:
        """The error for flat element j at ``level`` (see _where)."""
        row, where = _where(j, level, token_row, n_entries, spec)
        return InvalidArgument(f"table {table!r}: row {row_offset + row}, column {COLUMN!r}: {where}{what}")

    if not _listlike(arr.type) or not _listlike(arr.type.value_type) or not _listlike(arr.type.value_type.value_type) \
            or not pa.types.is_integer(arr.type.value_type.value_type.value_type):
        raise InvalidArgument(f"table {table!r}: column {COLUMN!r}: {arr.type} is not a list of per-token "
                              f"[layers][top_k] integer ids; expected {spec.arrow_type}")
    n_entries = _lengths(arr)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(valid & (n_entries != token_counts))
    if len(bad):
        r = int(bad[0])
        raise InvalidArgument(f"table {table!r}: row {row_offset + r}, column {COLUMN!r}: {n_entries[r]} entries; "
                              f"expected {token_counts[r]}, one per token (the length of tokens)")
    token_row = _owner(n_entries)  # the row of each token entry (one int per token: affordable)
    per_token = pc.list_flatten(arr)
    for level, (want, what) in enumerate(((spec.layers, "layers"), (spec.top_k, "experts"))):
        if per_token.null_count:
            j = int(np.argmax(per_token.is_null().to_numpy(zero_copy_only=False)))
            raise fail(j, level, " is null; entries must not hold nulls")
        sizes = _lengths(per_token)
        wrong = np.flatnonzero(sizes != want)
        if len(wrong):
            j = int(wrong[0])
            raise fail(j, level, f" has {sizes[j]} {what}; expected {want}")
        per_token = pc.list_flatten(per_token)
    ids = per_token
    if ids.null_count:
        j = int(np.argmax(ids.is_null().to_numpy(zero_copy_only=False)))
        raise fail(j, 2, " is null; expected an expert id")
    values = ids.to_numpy(zero_copy_only=False)
    if len(values) and (values.min() < 0 or values.max() >= spec.num_experts):
        j = int(np.argmax((values < 0) | (values >= spec.num_experts)))
        raise fail(j, 2, f": expert id {values[j]}; expected an id in [0, {spec.num_experts}) (the table's num_experts)")


def _listlike(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _lengths(arr: pa.Array) -> np.ndarray:
    return pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _owner(lengths: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(lengths)), lengths)


def _where(j: int, level: int, token_row: np.ndarray, n_entries: np.ndarray,
           spec: RoutedExpertsSpec) -> tuple[int, str]:
    """(row, "token T[, layer L[, expert K]]") of flat element j at ``level`` (0: a token's
    entry, 1: a layer's list, 2: an id); the levels above it have the declared sizes."""
    if level == 2:
        j, k = divmod(j, spec.top_k)
    if level >= 1:
        j, layer = divmod(j, spec.layers)
    row = int(token_row[j])
    token = j - int(np.cumsum(n_entries)[row] - n_entries[row])
    where = f"token {token}" + (f", layer {layer}" if level >= 1 else "") + (f", expert {k}" if level == 2 else "")
    return row, where

