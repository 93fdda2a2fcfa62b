"""Which shard stores a row: rendezvous (highest random weight) hashing of its key.

Each key scores every shard with a 64-bit hash of (key, shard name) and goes to the
highest score. The hash is FNV-1a over the UTF-8 bytes, finished by murmur3's fmix64, so
it is the same in every process and on every machine (Python's ``hash()`` is salted per
process), and the winner depends on the set of shard names, never on their order.
Adding or removing a shard moves only the keys it wins or held (about 1/n of them).

The key of a row is its ``group_id`` (a GRPO group never splits across shards), else its
``traj_id`` (or the table's ``key_column``). Only distinct keys are hashed (the column is
dictionary-encoded), in numpy: a loop over byte positions, never over rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def fmix64(h: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer: every input bit affects every output bit."""
    h = np.asarray(h, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xC4CEB9FE1A85EC53)
        h ^= h >> np.uint64(33)
    return h


def hash_strings(values: pa.Array | pa.ChunkedArray | Sequence[str]) -> np.ndarray:
    """uint64 hash of each string (a null hashes like ""), stable across processes."""
    arr = pa.chunked_array([values]) if not isinstance(values, (pa.Array, pa.ChunkedArray)) else values
    arr = pc.cast(pc.fill_null(arr, ""), pa.large_string())
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    _, offset_buffer, data_buffer = arr.buffers()
    offsets = np.frombuffer(offset_buffer, dtype=np.int64)[arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buffer or b"", dtype=np.uint8)
    lengths = np.diff(offsets)
    h = np.full(len(arr), _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(int(lengths.max(initial=0))):
            rows = np.flatnonzero(lengths > j)
            h[rows] = (h[rows] ^ data[offsets[rows] + j].astype(np.uint64)) * _FNV_PRIME
    return fmix64(h)


def place(keys: pa.Array | pa.ChunkedArray, shards: Sequence[str]) -> np.ndarray:
    """For each key (a null places like ""), the index into ``shards`` of its shard."""
    if not shards:
        raise ValueError("no shards to place rows on")
    if len(keys) == 0:
        return np.zeros(0, dtype=np.int64)
    encoded = pc.dictionary_encode(pc.fill_null(keys, ""))
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.unify_dictionaries().combine_chunks()
    shard_hash = fmix64(hash_strings(list(shards)))
    scores = fmix64(hash_strings(encoded.dictionary)[:, None] ^ shard_hash[None, :])  # (distinct keys, shards)
    return np.argmax(scores, axis=1)[encoded.indices.to_numpy()]


def placement_keys(data: pa.Table, key_column: str | None) -> pa.ChunkedArray | None:
    """The column rows are placed by: ``group_id`` where set, else the key column
    (``traj_id`` for trajectory tables); None when the rows have neither."""
    names = [n for n in ("group_id", key_column or "traj_id") if n in data.column_names]
    if not names:
        return None
    columns = [pc.cast(data.column(n), pa.string()) for n in names]
    return columns[0] if len(columns) == 1 else pc.coalesce(*columns)
