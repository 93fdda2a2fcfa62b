"""Idempotency keys of a table: a row whose key is known is not stored twice.

A key is known while its item is live, and for the next ``window`` removals after it
leaves (FIFO), so a producer retrying an insert after a timeout never duplicates rows
the table has already trained on and evicted. Lookups are one dict probe per row; the
window costs about 100 bytes per remembered key. Not thread-safe: the table holds its lock.

Each pass over an insert's keys runs in C (``map`` of a dict method), never a Python
loop per key: 256 keys were looked up in ~110 us by a generator, ~15 us so.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import Sequence

import numpy as np


class KeyRegistry:
    def __init__(self, window: int) -> None:
        self.window = window
        self._live: dict[str, int] = {}  # live key -> item id
        self._removed: OrderedDict[str, int] = OrderedDict()  # recently removed key -> item id
        self._of_slot = np.empty(0, dtype=object)

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        """uint64 item ids of known keys, 0 for unknown ones."""
        ids = np.fromiter(map(self._live.get, keys, repeat(0)), dtype=np.uint64, count=len(keys))
        if self._removed:  # item ids start at 1: 0 is "not live"
            removed = np.fromiter(map(self._removed.get, keys, repeat(0)), dtype=np.uint64, count=len(keys))
            ids = np.where(ids == 0, removed, ids)
        return ids

    def add(self, slots: np.ndarray, keys: list[str], ids: np.ndarray) -> None:
        if len(self._of_slot) <= int(slots.max(initial=-1)):
            self._of_slot = np.resize(self._of_slot, max(16, 2 * (int(slots.max()) + 1)))
        self._of_slot[slots] = keys
        self._live.update(zip(keys, ids.tolist()))

    def remove(self, slots: np.ndarray, ids: np.ndarray, remember: bool = True) -> None:
        """The items in ``slots`` left: their keys move to the removed window (unless not
        ``remember``: a quarantined item's rows may be inserted again)."""
        keys = self._of_slot[slots].tolist()
        self._of_slot[slots] = None
        _consume(map(self._live.pop, keys, repeat(None)))
        if self.window and remember:
            self._removed.update(zip(keys, ids.tolist()))
        _consume(map(self._removed.popitem, repeat(False, len(self._removed) - self.window)))  # oldest first

    def keys_of(self, slots: np.ndarray) -> list[str]:
        return self._of_slot[slots].tolist()

    def removed(self) -> tuple[list[str], np.ndarray]:
        """The removal window, oldest first (for snapshots)."""
        return list(self._removed), np.fromiter(self._removed.values(), dtype=np.uint64, count=len(self._removed))

    def restore_removed(self, keys: list[str], ids: np.ndarray) -> None:
        self._removed.update(zip(keys, ids.tolist()))


def _consume(calls) -> None:
    """Run an iterator of calls to the end (in C), dropping their results."""
    deque(calls, maxlen=0)
