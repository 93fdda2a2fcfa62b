"""The chunks of one table: record batches held by a tier, refcounted by live items.

Ownership::

    Table ── ItemIndex: slot -> (chunk id, row) ──┐
      └── ChunkStore: chunk id -> live count, rows ├─> Tier: chunk id -> RecordBatch
                                                   ┘
A chunk is written once (one per insert message, or per compaction) and freed when its
last live item leaves. ``compaction_candidates`` picks the chunks worth rewriting into
one: mostly-dead ones (rows of items that left pin their bytes) and small ones (a
producer's 8-row insert is a 2 KiB chunk; gathering a sample from thousands of them costs
a slice each, from a few 8 MiB ones one take each). Byte budgets belong to the tier; this
class counts. Not thread-safe: the table holds its lock.
"""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa

from .tiers.base import Tier


class ChunkStore:
    COMPACT_MIN_BYTES = 16 << 20   # dead bytes below this are never worth a compaction
    COMPACT_PASS_BYTES = 32 << 20  # live bytes one compaction pass copies, at most
    SMALL_CHUNK_BYTES = 1 << 20    # chunks below this are merged ...
    MERGE_BYTES = 8 << 20          # ... once this many bytes of them have accumulated

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._next = 0
        self._live: dict[int, int] = {}  # chunk id -> live items referencing it
        self._rows: dict[int, int] = {}  # chunk id -> rows it holds
        self._small: dict[int, int] = {}  # small live chunk id -> bytes, oldest first
        self._small_bytes = 0
        self.dead_bytes = 0.0

    def __len__(self) -> int:
        return len(self._live)

    def add(self, batch: pa.RecordBatch) -> int:
        """Store a chunk whose every row is a live item; returns its id."""
        chunk = self._next
        self._next += 1
        self.tier.put(chunk, batch)
        self._live[chunk] = self._rows[chunk] = batch.num_rows
        size = self.tier.size_of(chunk)
        if size < self.SMALL_CHUNK_BYTES:
            self._small[chunk] = size
            self._small_bytes += size
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
                self._forget(c)
                freed.append(c)
        self.tier.delete(freed)

    def _forget(self, chunk: int) -> None:
        del self._live[chunk], self._rows[chunk]
        self._small_bytes -= self._small.pop(chunk, 0)

    def compaction_candidates(self) -> list[int]:
        """Chunks to rewrite into one, or none. Once dead rows hold a quarter of the tier
        (and at least COMPACT_MIN_BYTES): the chunks under half live, deadest first, whose
        live rows add up to about COMPACT_PASS_BYTES. Otherwise, once MERGE_BYTES of
        small chunks have accumulated: the oldest of them, about MERGE_BYTES' worth.
        O(1) when there is nothing to do, so it can run after every insert and removal."""
        if self.dead_bytes >= max(self.COMPACT_MIN_BYTES, self.tier.nbytes / 4):
            fraction = {c: n / self._rows[c] for c, n in self._live.items() if 2 * n < self._rows[c]}
            chosen, budget = [], self.COMPACT_PASS_BYTES
            for c in sorted(fraction, key=fraction.get):
                cost = self.tier.size_of(c) * fraction[c]
                if chosen and cost > budget:
                    break
                chosen.append(c)
                budget -= cost
            if chosen:
                return chosen
        if self._small_bytes >= self.MERGE_BYTES and len(self._small) > 1:
            chosen, total = [], 0
            for c, size in self._small.items():
                chosen.append(c)
                total += size
                if total >= self.MERGE_BYTES:
                    break
            return chosen
        return []

    def replace(self, chunks: list[int], live_rows: pa.RecordBatch) -> int:
        """Swap ``chunks`` for one chunk of their live rows (the caller re-points its items)."""
        for c in chunks:
            self.dead_bytes -= self.tier.size_of(c) * (1 - self._live[c] / self._rows[c])
            self._forget(c)
        self.tier.delete(chunks)
        return self.add(live_rows)
