"""The chunks of one table: record batches held by a tier, refcounted by live items.

Ownership::

    Table ── ItemIndex: slot -> (chunk id, row) ──┐
      └── ChunkStore: chunk id -> live count, rows ├─> Placement -> memory / SSD / remote
                                                   ┘
A chunk is written once (one per insert message, or per compaction) and freed when its
last live item leaves. ``compaction_candidates`` picks the chunks worth rewriting into
one: mostly-dead ones (rows of items that left pin their bytes) and small ones (a
producer's 8-row insert is a 2 KiB chunk; a sample pays for every chunk it touches).
Where chunks live belongs to the placement, byte budgets to the tiers; this class counts.
Not thread-safe: the table holds its lock.
"""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa

from .placement import Placement, Staged


class ChunkStore:
    COMPACT_MIN_BYTES = 16 << 20   # dead bytes below this are never worth a compaction
    COMPACT_PASS_BYTES = 32 << 20  # live bytes one compaction pass copies, at most
    # Chunks below this are merged ... Merging rewrites rows (on the table's background
    # thread, movement.py), and still pays with the native gather: measured over gRPC, 256-row
    # samples of 300 B rows from 800 unmerged 77 KB chunks took 3.8-5.4 ms, 2.3-2.6 from
    # merged ones (every chunk a sample touches costs its read plan and gather a share),
    # while not merging them made those inserts only ~12% faster (4.5 against 5.2 ms).
    SMALL_CHUNK_BYTES = 1 << 20
    MERGE_BYTES = 8 << 20          # ... once this many bytes of them have accumulated

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self._live: dict[int, int] = {}  # chunk id -> live items referencing it
        self._rows: dict[int, int] = {}  # chunk id -> rows it holds
        self._bytes: dict[int, int] = {}  # chunk id -> Arrow bytes
        # small chunk id -> bytes, oldest first: resident when written (dropped once seen on disk)
        self._small: dict[int, int] = {}
        self._small_bytes = 0
        self.nbytes = 0  # Arrow bytes of every chunk, in whichever tier
        self.dead_bytes = 0.0

    def __len__(self) -> int:
        return len(self._live)

    def ids(self) -> list[int]:
        """Every chunk a live item references."""
        return list(self._live)

    def __contains__(self, chunk: int) -> bool:
        return chunk in self._live

    def stage(self, batch: pa.RecordBatch, durability: str = "memory") -> Staged:
        return self.placement.stage(batch, durability)

    def add(self, batch: pa.RecordBatch | Staged, live: int | None = None) -> int:
        """Store a chunk (or take one staged outside the lock) of which ``live`` rows
        (default: all) are live items; returns its id."""
        staged = batch if isinstance(batch, Staged) else self.stage(batch)
        self.placement.add(staged)
        rows = staged.batch.num_rows
        self._track(staged.chunk_id, rows, rows if live is None else live,
                    staged.batch.get_total_buffer_size())
        return staged.chunk_id

    def adopt(self, chunk: int, rows: int, live: int, nbytes: int) -> None:
        """Track a chunk written before a restart (the placement has adopted it)."""
        self._track(chunk, rows, live, nbytes)

    def _track(self, chunk: int, rows: int, live: int, size: int) -> None:
        self._live[chunk], self._rows[chunk], self._bytes[chunk] = live, rows, size
        self.nbytes += size
        self.dead_bytes += size * (rows - live) / max(rows, 1)
        if size < self.SMALL_CHUNK_BYTES and self.placement.resident(chunk):
            self._small[chunk] = size
            self._small_bytes += size

    def size_of(self, chunk: int) -> int:
        return self._bytes[chunk]

    def get(self, chunks: Iterable[int]) -> dict[int, pa.RecordBatch]:
        return self.placement.get(list(chunks))

    def freed_by(self, chunks: Iterable[int], counts: Iterable[int]) -> int:
        """Bytes that releasing ``counts[i]`` items of ``chunks[i]`` would free."""
        return sum(self._bytes[c] for c, k in zip(chunks, counts) if self._live[c] == k)

    def release(self, chunks: Iterable[int], counts: Iterable[int]) -> list[int]:
        """``counts[i]`` items of ``chunks[i]`` left; returns the chunks nobody references
        any more (forgotten here; the caller deletes or archives them)."""
        freed = []
        for c, k in zip(chunks, counts):
            left = self._live[c] - k
            per_row = self._bytes[c] / self._rows[c]
            if left:
                self._live[c] = left
                self.dead_bytes += k * per_row
            else:  # the chunk goes: its dead rows stop counting
                self.dead_bytes -= (self._rows[c] - k) * per_row
                self._forget(c)
                freed.append(c)
        return freed

    def _forget(self, chunk: int) -> None:
        del self._live[chunk], self._rows[chunk]
        self.nbytes -= self._bytes.pop(chunk)
        self._small_bytes -= self._small.pop(chunk, 0)

    def compaction_candidates(self) -> list[int]:
        """Resident chunks to rewrite into one, or none. Once dead rows hold a quarter
        of the bytes (and at least COMPACT_MIN_BYTES): the resident chunks under half
        live, deadest first, whose live rows add up to about COMPACT_PASS_BYTES.
        Otherwise, once MERGE_BYTES of small chunks have accumulated: the oldest of them,
        about MERGE_BYTES' worth. O(1) when there is nothing to do, so it can run after
        every insert and removal. Chunks on disk are left alone: there dead rows cost
        only disk space, and rewriting them would read under the table lock."""
        if self.dead_bytes >= max(self.COMPACT_MIN_BYTES, self.nbytes / 4):
            resident = self.placement.resident
            fraction = {c: n / self._rows[c] for c, n in self._live.items()
                        if 2 * n < self._rows[c] and resident(c)}
            chosen, budget = [], self.COMPACT_PASS_BYTES
            for c in sorted(fraction, key=fraction.get):
                cost = self._bytes[c] * fraction[c]
                if chosen and cost > budget:
                    break
                chosen.append(c)
                budget -= cost
            if chosen:
                return chosen
        if self._small_bytes >= self.MERGE_BYTES and len(self._small) > 1:
            chosen, total, evicted = [], 0, []
            for c, size in self._small.items():
                if not self.placement.resident(c):
                    evicted.append(c)
                    continue
                chosen.append(c)
                total += size
                if total >= self.MERGE_BYTES:
                    break
            for c in evicted:  # left the memory tier: not merged (see above), not walked again
                self._small_bytes -= self._small.pop(c)
            if len(chosen) > 1 and total >= self.MERGE_BYTES:
                return chosen
        return []

    def replace(self, chunks: list[int], rows: pa.RecordBatch | Staged, live: int | None = None) -> int:
        """Swap ``chunks`` for one chunk of their rows, ``live`` of them (default: all)
        live items (the caller re-points its items)."""
        for c in chunks:
            self.dead_bytes -= self._bytes[c] * (1 - self._live[c] / self._rows[c])
            self._forget(c)
        self.placement.delete(chunks)
        return self.add(rows, live)
