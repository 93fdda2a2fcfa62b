"""The chunks of one table: record batches held by a tier, refcounted by live items.

Ownership::

    Table ── ItemIndex: slot -> (chunk id, row) ──┐
      └── ChunkStore: chunk id -> live count, rows ├─> Tier: chunk id -> RecordBatch
                                                   ┘
A chunk is written once (one per insert message, or per compaction) and freed when its
last live item leaves. Rows of items that left but whose chunk lives on are *dead
bytes*; ``compaction_candidates`` picks the chunks worth rewriting. Byte budgets belong to
the tier; this class counts. Not thread-safe: the table holds its lock.
"""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa

from .tiers.base import Tier


class ChunkStore:
    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._next = 0
        self._live: dict[int, int] = {}  # chunk id -> live items referencing it
        self._rows: dict[int, int] = {}  # chunk id -> rows it holds
        self.dead_bytes = 0.0

    def __len__(self) -> int:
        return len(self._live)

    def add(self, batch: pa.RecordBatch) -> int:
        """Store a chunk whose every row is a live item; returns its id."""
        chunk = self._next
        self._next += 1
        self.tier.put(chunk, batch)
        self._live[chunk] = self._rows[chunk] = batch.num_rows
        return chunk

    def get(self, chunks: Iterable[int]) -> dict[int, pa.RecordBatch]:
        return self.tier.get(chunks)

    def freed_by(self, chunks: Iterable[int], counts: Iterable[int]) -> int:
        """Bytes that releasing ``counts[i]`` items of ``chunks[i]`` would free."""
        return sum(self.tier.size_of(c) for c, k in zip(chunks, counts) if self._live[c] == k)

    def release(self, chunks: Iterable[int], counts: Iterable[int]) -> None:
        """``counts[i]`` items of ``chunks[i]`` left; free the chunks nobody references."""
        freed = []
        for c, k in zip(chunks, counts):
            left = self._live[c] - k
            per_row = self.tier.size_of(c) / self._rows[c]
            if left:
                self._live[c] = left
                self.dead_bytes += k * per_row
            else:  # the chunk goes: its dead rows stop counting
                self.dead_bytes -= (self._rows[c] - k) * per_row
                del self._live[c], self._rows[c]
                freed.append(c)
        self.tier.delete(freed)

    def compaction_candidates(self, min_dead_bytes: int, pass_bytes: int) -> list[int]:
        """Once dead rows hold a quarter of the tier (and at least ``min_dead_bytes``):
        the chunks under half live, deadest first, whose live rows add up to about
        ``pass_bytes``. Empty when compaction is not worth a pass."""
        if self.dead_bytes < max(min_dead_bytes, self.tier.nbytes / 4):
            return []
        fraction = {c: n / self._rows[c] for c, n in self._live.items() if 2 * n < self._rows[c]}
        chosen, budget = [], pass_bytes
        for c in sorted(fraction, key=fraction.get):
            cost = self.tier.size_of(c) * fraction[c]
            if chosen and cost > budget:
                break
            chosen.append(c)
            budget -= cost
        return chosen

    def replace(self, chunks: list[int], live_rows: pa.RecordBatch) -> int:
        """Swap ``chunks`` for one chunk of their live rows (the caller re-points its items)."""
        for c in chunks:
            self.dead_bytes -= self.tier.size_of(c) * (1 - self._live[c] / self._rows[c])
            del self._live[c], self._rows[c]
        self.tier.delete(chunks)
        return self.add(live_rows)
