"""SampleBatch: rows out of the store, as Arrow, numpy or torch without needless copies.

The Arrow data points into the received gRPC buffers. ``to_numpy`` hands out views of
those buffers where the layout allows (fixed-width columns without nulls, and the values
and offsets of list columns); ``to_torch`` wraps the same memory with
``torch.from_numpy``. Padding to a dense (B, T) tensor is the one place that copies.
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from .tensors import cell_shape, flat


class Ragged(NamedTuple):
    """A list column packed with offsets: row i is ``values[offsets[i]:offsets[i+1]]``
    (``cu_seqlens`` in varlen-attention terms); offsets start at 0."""

    values: Any
    offsets: Any


@dataclass
class SampleBatch:
    ids: np.ndarray            # uint64 item ids, row-aligned with data
    data: pa.Table
    priorities: np.ndarray
    times_sampled: np.ndarray
    policy_versions: np.ndarray
    probabilities: np.ndarray | None = None  # Sample only
    weights: np.ndarray | None = None        # Sample only: importance weights
    _ack: Callable[[], Any] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.data.num_rows

    def ack(self):
        """Ack these rows to their consumer group (stream batches only)."""
        if self._ack is None:
            raise TypeError("only batches from stream() can be acked")
        return self._ack()

    def acked_by(self, ack: Callable[[], Any]) -> "SampleBatch":
        """The same rows, acked by calling ``ack`` (a stream hands out its batches so)."""
        return replace(self, _ack=ack)

    def column(self, name: str) -> pa.Array:
        col = self.data.column(name)
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()

    def to_numpy(self, columns: list[str] | None = None) -> dict[str, Any]:
        """Fixed-width columns -> ndarray (a view when there are no nulls); lists of
        fixed-width values -> Ragged(values, offsets) views; lists of per-token tensors
        (``routed_experts``) -> Ragged with values of shape (sum T, layers, top_k);
        other columns -> Arrow arrays."""
        return {name: _to_numpy(self.column(name)) for name in (columns or self.data.column_names)}

    def to_torch(self, columns: list[str] | None = None, pad_to: int | str | None = None,
                 pad_value: float = 0) -> dict[str, Any]:
        """Numeric columns as torch tensors sharing memory with the batch.

        pad_to=None packs list columns as Ragged(values, offsets) tensors (no copy);
        pad_to="max" or an int pads them into dense (B, T) tensors (a copy), truncating
        rows longer than an int ``pad_to``; per-token tensors pad to (B, T, *cell), e.g.
        ``routed_experts`` to (B, T, layers, top_k). String and nested columns are skipped.
        Tensors that share memory are views of the received buffer: read them, or
        ``.clone()`` before writing in place.
        """
        import torch

        def from_numpy(a: np.ndarray):
            with warnings.catch_warnings():  # read-only wire memory: documented above
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a)

        out: dict[str, Any] = {}
        for name, value in self.to_numpy(columns).items():
            if isinstance(value, Ragged):
                if pad_to is None:
                    out[name] = Ragged(from_numpy(value.values), from_numpy(value.offsets))
                else:
                    out[name] = torch.from_numpy(pad(value, pad_to, pad_value))
            elif isinstance(value, np.ndarray) and value.dtype != object:
                out[name] = from_numpy(value)
        return out

    def lengths(self, column: str) -> np.ndarray:
        """Per-row lengths of a list column."""
        offsets = _offsets(self.column(column))
        return np.diff(offsets)


def pad(ragged: Ragged, pad_to: int | str, pad_value: float = 0) -> np.ndarray:
    """Ragged -> dense (B, T, ...) array (values of shape (N, ...)); T = longest row for "max"."""
    offsets = np.asarray(ragged.offsets)
    lengths = np.diff(offsets)
    width = int(lengths.max(initial=0)) if pad_to == "max" else int(pad_to)
    values = np.asarray(ragged.values)
    out = np.full((len(lengths), width, *values.shape[1:]), pad_value, dtype=values.dtype)
    keep = np.minimum(lengths, width)
    # Scatter all rows at once: position of each kept value in the flat output.
    rows = np.repeat(np.arange(len(lengths)), keep)
    cols = np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep, keep)
    src = np.repeat(offsets[:-1], keep) + cols
    out[rows, cols] = values[src]
    return out


def _offsets(arr: pa.Array) -> np.ndarray:
    offsets = arr.offsets.to_numpy()
    return offsets - offsets[0] if offsets[0] else offsets


def _to_numpy(arr: pa.Array) -> Any:
    t = arr.type
    if cell_shape(t) is not None and arr.null_count == 0:
        return Ragged(*flat(arr))
    if (pat.is_list(t) or pat.is_large_list(t)) and _fixed_width(t.value_type) and arr.null_count == 0:
        offsets = arr.offsets.to_numpy()
        values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
        if values.null_count == 0:
            return Ragged(values.to_numpy(zero_copy_only=not pat.is_boolean(t.value_type)),
                          offsets - offsets[0] if offsets[0] else offsets)
    if _fixed_width(t):
        return arr.to_numpy(zero_copy_only=False)
    if pat.is_string(t) or pat.is_large_string(t):
        return arr.to_numpy(zero_copy_only=False)
    return arr


def _fixed_width(t: pa.DataType) -> bool:
    return pat.is_integer(t) or pat.is_floating(t) or pat.is_boolean(t)
