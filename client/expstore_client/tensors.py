"""Per-token tensors: list columns whose values are (nested) fixed-size lists of numbers.

A row of ``list<fixed_size_list<fixed_size_list<uint8, k>, L>>`` (the ``routed_experts``
column of an MoE table: per token, the top-k expert ids of each of L layers) is a
(T, L, k) array. Arrow stores the whole column as one flat buffer of numbers plus one
offset per row, so a batch converts to a (sum T, L, k) view without a copy, and padding
gives the (B, T, L, k) tensor a trainer replays the router with.

>>> col = tensor_list([np.zeros((3, 2, 4), np.uint8), None], pa.list_(pa.list_(pa.list_(pa.uint8(), 4), 2)))
>>> values, offsets = flat(col)
>>> values.shape, offsets.tolist()
((3, 2, 4), [0, 3, 3])
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.types as pat


def cell_shape(t: pa.DataType) -> tuple[tuple[int, ...], pa.DataType] | None:
    """((L, k), uint8) for list<fixed_size_list<fixed_size_list<uint8, k>, L>>: the shape
    of one token's cell and its number type; None for any other type."""
    if not (pat.is_list(t) or pat.is_large_list(t)):
        return None
    dims, inner = [], t.value_type
    while pat.is_fixed_size_list(inner):
        dims.append(inner.list_size)
        inner = inner.value_type
    if not dims or not (pat.is_integer(inner) or pat.is_floating(inner)):
        return None
    return tuple(dims), inner


def tensor_list(rows: Sequence[Any], t: pa.DataType) -> pa.Array:
    """Rows of (T_i, *cell) arrays (None: a null row) as an Arrow array of type ``t``:
    one copy into the column's number type (a safe cast: out-of-range values raise)."""
    shape, number = cell_shape(t)
    rows = list(rows)
    arrays = [None if r is None else np.asarray(r) for r in rows]
    for a in arrays:
        if a is not None and tuple(a.shape[1:]) != shape:
            raise ValueError(f"each row must be a (tokens, {', '.join(map(str, shape))}) array, got {a.shape}")
    lengths = np.array([0 if a is None else len(a) for a in arrays], np.int64)
    offsets = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat_values = [a.reshape(-1) for a in arrays if a is not None]
    values = pa.array(np.concatenate(flat_values) if flat_values else np.zeros(0, np.int64))
    values = values.cast(number, safe=True)
    for size in reversed(shape):
        values = pa.FixedSizeListArray.from_arrays(values, size)
    mask = pa.array([a is None for a in arrays]) if any(a is None for a in arrays) else None
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask)


def flat(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values of shape (sum T, *cell), offsets from 0) of a tensor-list array, views of
    its buffers (no copy) when it has no nulls inside."""
    shape, _ = cell_shape(arr.type)
    offsets = arr.offsets.to_numpy()
    cells = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
    numbers = cells
    for _ in shape:
        numbers = numbers.flatten()
    values = numbers.to_numpy(zero_copy_only=numbers.null_count == 0 and not pat.is_boolean(numbers.type))
    return values.reshape((len(cells), *shape)), offsets - offsets[0]
