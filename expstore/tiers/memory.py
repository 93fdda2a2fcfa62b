"""Memory tier: chunks as Arrow record batches in a dict, bounded in bytes.

A chunk decoded from the wire references the received buffer, so holding it costs the
payload bytes and nothing more; ``nbytes`` counts whole Arrow buffers (a slice holds its
parent's buffers alive). Not thread-safe: the table holds its lock.
"""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa

from ..errors import NotFound


class MemoryTier:
    name = "memory"

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._chunks: dict[int, pa.RecordBatch] = {}
        self._sizes: dict[int, int] = {}
        self._nbytes = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def budget(self) -> int:
        return self._budget

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, chunk_id: int) -> bool:
        return chunk_id in self._chunks

    def size_of(self, chunk_id: int) -> int:
        return self._sizes[chunk_id]

    def oldest(self) -> int:
        """The chunk held longest (dicts keep insertion order): what a cache drops first."""
        return next(iter(self._chunks))

    def get_one(self, chunk_id: int) -> pa.RecordBatch:
        return self._chunks[chunk_id]

    def put(self, chunk_id: int, batch: pa.RecordBatch, durability: str = "memory") -> None:
        size = batch.get_total_buffer_size()
        self._chunks[chunk_id] = batch
        self._sizes[chunk_id] = size
        self._nbytes += size

    def get(self, chunk_ids: Iterable[int]) -> dict[int, pa.RecordBatch]:
        try:
            return {c: self._chunks[c] for c in chunk_ids}
        except KeyError as e:
            raise NotFound(f"chunk {e.args[0]} is not in the memory tier") from None

    def delete(self, chunk_ids: Iterable[int]) -> None:
        for c in chunk_ids:
            if c in self._chunks:
                del self._chunks[c]
                self._nbytes -= self._sizes.pop(c)
