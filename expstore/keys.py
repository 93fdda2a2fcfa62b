"""Idempotency keys of a table: a row whose key is known is not stored twice.

A key is known while its item is live, and for the next ``window`` removals after it
leaves (FIFO), so a producer retrying an insert after a timeout never duplicates rows
the table has already trained on and evicted. Lookups are one dict probe per row; the
window costs about 190 bytes per remembered key of 12 characters (the string, its dict
entry and its copy in Arrow). Not thread-safe: the table holds its lock.

Each pass over an insert's keys runs in C (``map`` of a dict method), never a Python
loop per key: 256 keys were looked up in ~110 us by a generator, ~25 us so.

One dict holds every known key, live or in the window (a removal touches no dict; a
lookup is one probe). The window's keys are also kept in the order they left, in batches
of about ``SEAL_KEYS``: a list (to forget them) and, once the batch is full, an Arrow
array (for snapshots). A snapshot, taken under the table's lock, chunks those arrays: with
the default window of a million keys, listing an ordered dict's keys and ids took 0.41-0.45 s
under the lock in a server (every insert and sample of the table waited), and converting
the list to Arrow ~0.27 s more on the snapshot writer, holding the GIL; now 1-3 ms under
the lock and ~40 ms to pack, and each key is converted once, when its batch fills.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import Sequence

import numpy as np
import pyarrow as pa


SEAL_KEYS = 4096  # removed keys gathered before they are converted to Arrow (once)


class KeyRegistry:
    def __init__(self, window: int, seal_keys: int = SEAL_KEYS) -> None:
        self.window = window
        # Every known key -> its item id: live ones, and those in the window. A key that
        # leaves keeps its entry until it is forgotten (a removal touches no dict): it
        # cannot be stored again meanwhile (a duplicate), so it never leaves twice.
        self._known: dict[str, int] = {}
        self._batches: deque[_Batch] = deque()  # the window's keys in the order they left
        self._forgotten = 0  # keys of the oldest batch already forgotten
        self._remembered = 0  # keys in the window
        self.seal_keys = seal_keys
        self._of_slot = np.empty(0, dtype=object)

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        """uint64 item ids of known keys, 0 for unknown ones (item ids start at 1)."""
        return np.fromiter(map(self._known.get, keys, repeat(0)), dtype=np.uint64, count=len(keys))

    def add(self, slots: np.ndarray, keys: list[str], ids: np.ndarray) -> None:
        if len(self._of_slot) <= int(slots.max(initial=-1)):
            self._of_slot = np.resize(self._of_slot, max(16, 2 * (int(slots.max()) + 1)))
        self._of_slot[slots] = keys
        self._known.update(zip(keys, ids.tolist()))

    def remove(self, slots: np.ndarray, ids: np.ndarray, remember: bool = True) -> None:
        """The items in ``slots`` left: their keys move to the removed window (unless not
        ``remember``: a quarantined item's rows may be inserted again)."""
        keys = self._of_slot[slots].tolist()
        self._of_slot[slots] = None
        if self.window and remember:
            self._remember(keys, ids.tolist())
        else:
            _consume(map(self._known.pop, keys, repeat(None)))
        self._forget_oldest()

    def keys_of(self, slots: np.ndarray) -> list[str]:
        return self._of_slot[slots].tolist()

    def removed(self) -> tuple[pa.ChunkedArray, np.ndarray]:
        """The removal window, oldest first (for snapshots): its keys (large_string) and ids."""
        parts = [b.arrays() for b in self._batches]
        if parts:
            keys, ids = parts[0]
            parts[0] = keys.slice(self._forgotten), ids[self._forgotten:]
        return (pa.chunked_array([k for k, _ in parts], pa.large_string()),
                np.concatenate([i for _, i in parts]) if parts else np.zeros(0, np.uint64))

    def restore_removed(self, keys: list[str], ids: np.ndarray) -> None:
        """The window of a snapshot (``removed``), before any removal since."""
        ids = np.asarray(ids).tolist()
        self._known.update(zip(keys, ids))
        self._remember(list(keys), ids)

    def _remember(self, keys: list[str], ids: list[int]) -> None:
        if not self._batches or self._batches[-1].sealed:
            self._batches.append(_Batch())
        self._batches[-1].extend(keys, ids, self.seal_keys)
        self._remembered += len(keys)

    def _forget_oldest(self) -> None:
        """Forget the keys that left longest ago until at most ``window`` are remembered."""
        while self._remembered > self.window:
            keys = self._batches[0].keys
            end = min(len(keys), self._forgotten + self._remembered - self.window)
            _consume(map(self._known.pop, keys[self._forgotten:end], repeat(None)))
            self._remembered -= end - self._forgotten
            self._forgotten = end
            if end == len(keys):
                self._batches.popleft()
                self._forgotten = 0


class _Batch:
    """Keys that left one after another, and their ids. Sealed once it holds ``seal_keys``:
    its keys then also an Arrow array, its ids a numpy array, and it never changes."""

    __slots__ = ("keys", "ids", "arrow")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.ids: list[int] | np.ndarray = []
        self.arrow: pa.Array | None = None

    @property
    def sealed(self) -> bool:
        return self.arrow is not None

    def extend(self, keys: list[str], ids: list[int], seal_keys: int) -> None:
        self.keys += keys
        self.ids += ids
        if len(self.keys) >= seal_keys:
            self.arrow, self.ids = self.arrays()

    def arrays(self) -> tuple[pa.Array, np.ndarray]:
        if self.sealed:
            return self.arrow, self.ids
        return pa.array(self.keys, pa.large_string()), np.array(self.ids, dtype=np.uint64)


def _consume(calls) -> None:
    """Run an iterator of calls to the end (in C), dropping their results."""
    deque(calls, maxlen=0)
