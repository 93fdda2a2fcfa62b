"""Retention classes: a hot window for sampling and a total window for audits (Kafka's
KIP-405 ``local.retention.*`` and ``retention.*``).

The hot window (``hot_retention_s``, ``hot_retention_bytes``) bounds what is sampled:

- by time: an item leaves once ``inserted_at + hot_retention_s <= now`` (wall clock),
  looked for from the oldest id up to the first item still inside the window (ids follow
  insertion order; a wall clock that steps back delays a leave, never skips one);
- by bytes: while the chunks of the live items take more than ``hot_retention_bytes``
  (Arrow bytes, in whichever tier), the oldest chunk's items leave, oldest chunk first
  (the chunk of the oldest live item), as Kafka deletes whole segments.

Items leaving the hot window are removed from the sampling window with reason
``retention`` (counted in ``removed_retention``): with ``archive = true`` they move to the
archive (queryable by SQL and ``scan_archive``, never sampled again); without it they are
deleted, and the hot window is all the retention there is.

The total window (``retention_s``, ``retention_bytes``; needs ``archive = true``) bounds
the archive: a fragment (one per archived chunk) is deleted once the newest row in it was
inserted ``retention_s`` ago, and the oldest fragments are deleted while the table's live
bytes plus the archive's exceed ``retention_bytes``. Only archive fragments this table
wrote are ever deleted, each by its chunk id; live items are never touched by it.

Both windows are applied lazily: the hot window at every call on the table (under its
lock, at most ``MAX_LEAVING`` items a call, so a call's pause stays bounded), the total
window by the store's mover (remote I/O outside the lock). Everything is journaled by the
table (the removals, the archived fragments with their newest row and bytes, the
expiries), so a restart resumes both windows where they were.

Not thread-safe: the table holds its lock. No clocks: callers pass the wall-clock time.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from .index import ItemIndex

MAX_LEAVING = 65_536  # items one call may move out of the hot window


class Retention:
    def __init__(self, hot_s: float | None, hot_bytes: int | None, total_s: float | None,
                 total_bytes: int | None) -> None:
        self.hot_s, self.hot_bytes, self.total_s, self.total_bytes = hot_s, hot_bytes, total_s, total_bytes
        self._pending: dict[int, float] = {}  # chunk waiting for the archive -> newest inserted_at removed
        self._fragments: dict[int, tuple[float, int]] = {}  # archived chunk -> (newest inserted_at, bytes)

    # -- the hot window ---------------------------------------------------------------

    def leaving(self, index: ItemIndex, live_bytes: Callable[[], int], now: float) -> Iterator[np.ndarray]:
        """Slots of the live items leaving the hot window, oldest first, a batch at a
        time: the caller removes each batch before asking for the next (bytes fall as
        chunks are freed)."""
        left = MAX_LEAVING
        if self.hot_s is not None:
            cutoff = now - self.hot_s
            while left > 0:
                slots = index.slots_from(1, min(left, 4096))
                old = slots[:int(np.argmin(np.append(index["inserted_at"][slots] <= cutoff, False)))]
                if not len(old):
                    break
                left -= len(old)
                yield old
        while self.hot_bytes is not None and left > 0 and live_bytes() > self.hot_bytes:
            oldest = self._oldest_chunk(index, left)
            if not len(oldest):
                break
            left -= len(oldest)
            yield oldest

    @staticmethod
    def _oldest_chunk(index: ItemIndex, limit: int) -> np.ndarray:
        """The live items of the oldest live item's chunk that precede, in id order, any
        item of another chunk (at most ``limit``)."""
        k = 256
        while True:
            slots = index.slots_from(1, min(k, limit))
            if not len(slots):
                return slots
            chunks = index["chunk"][slots]
            other = np.flatnonzero(chunks != chunks[0])
            if len(other) or len(slots) < min(k, limit) or k >= limit:
                return slots[:other[0]] if len(other) else slots
            k *= 4

    # -- the archive (the total window) -----------------------------------------------

    def removed(self, chunks: np.ndarray, inserted_at: np.ndarray) -> None:
        """Items left the table and wait in their chunks for the archive."""
        for c, t in zip(*_newest(chunks, inserted_at)):
            self._pending[c] = max(t, self._pending.get(c, t))

    def archived(self, chunks, nbytes) -> None:
        """Chunks' removed rows were written to the archive as fragments of ``nbytes``
        (None: nothing was written, the rows were damaged)."""
        for i, c in enumerate(int(c) for c in chunks):
            newest = self._pending.pop(c, None)
            if nbytes is not None and newest is not None:
                self._fragments[c] = (newest, int(nbytes[i]))

    def expired(self, now: float, live_bytes: int) -> list[int]:
        """Archive fragments past the total window: by time, then the oldest while the
        table's live bytes plus the archive's exceed ``total_bytes``."""
        out = []
        if self.total_s is not None:
            out = [c for c, (newest, _) in self._fragments.items() if newest + self.total_s <= now]
        if self.total_bytes is not None:
            gone = set(out)
            total = live_bytes + sum(b for c, (_, b) in self._fragments.items() if c not in gone)
            for c in sorted(self._fragments):
                if total <= self.total_bytes:
                    break
                if c not in gone:
                    out.append(c)
                    total -= self._fragments[c][1]
        return sorted(out)

    def deleted(self, chunks) -> int:
        """Fragments were deleted from the archive; returns their bytes."""
        return sum(self._fragments.pop(int(c), (0.0, 0))[1] for c in chunks)

    # -- stats and persistence --------------------------------------------------------

    def stats(self) -> dict[str, float]:
        return {"archive_fragments": len(self._fragments),
                "archive_bytes": sum(b for _, b in self._fragments.values())}

    def state(self) -> dict:
        return {"pending": [[c, t] for c, t in self._pending.items()],
                "fragments": [[c, t, b] for c, (t, b) in self._fragments.items()]}

    def load(self, state: dict) -> None:
        self._pending = {int(c): float(t) for c, t in state["pending"]}
        self._fragments = {int(c): (float(t), int(b)) for c, t, b in state["fragments"]}


def _newest(chunks: np.ndarray, inserted_at: np.ndarray) -> tuple[list[int], list[float]]:
    """Per distinct chunk, the newest inserted_at of its entries."""
    if len(chunks) == 0:
        return [], []
    order = np.lexsort((inserted_at, chunks))
    c, t = chunks[order], inserted_at[order]
    last = np.append(c[1:] != c[:-1], True)
    return c[last].tolist(), t[last].tolist()
