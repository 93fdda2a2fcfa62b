"""The interface every payload tier implements.

Chunks are immutable record batches written once by ``put`` and freed by ``delete`` when
the table's last item referencing them leaves. ``get`` returns batches, never rows: the
caller takes the rows it needs outside the table lock.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import pyarrow as pa


UNBOUNDED = 1 << 62  # the budget of a tier whose puts nothing refuses


class Tier(Protocol):
    name: str

    @property
    def nbytes(self) -> int:
        """Bytes held (Arrow buffer sizes)."""

    @property
    def budget(self) -> int:
        """Bytes the tier may hold."""

    def __len__(self) -> int:
        """Chunks held."""

    def size_of(self, chunk_id: int) -> int:
        """Bytes one chunk holds (the measure of ``nbytes``)."""

    def put(self, chunk_id: int, batch: pa.RecordBatch, durability: str = "wal") -> None:
        """Store a chunk. The caller has checked the budget. ``durability`` (memory, wal,
        fsync) is what a durable tier guarantees when put returns; others ignore it."""

    def get(self, chunk_ids: Iterable[int]) -> dict[int, pa.RecordBatch]:
        """Read chunks in one batch call. Raises NotFound for an unknown id."""

    def delete(self, chunk_ids: Iterable[int]) -> None:
        """Free chunks; unknown ids are ignored (deletes are idempotent)."""
