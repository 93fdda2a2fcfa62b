"""The in-memory item index of one table: a struct of numpy arrays over slots.

A *slot* is a dense handle for a live item, reused after the item leaves, so every
per-item fact is one entry of a flat array and selectors can work on slot arrays. Item
ids are assigned by the index, monotonic in insertion order; ``lookup`` maps ids to slots
with a binary search over the id-ordered log of insertions, so batches of ids resolve in
O(k log n) numpy work. Not thread-safe: the table holds its lock.
"""

from __future__ import annotations

import numpy as np

# Per-slot columns and their dtypes. `chunk` and `row` locate the payload in the tiers.
COLUMNS: dict[str, type] = {
    "id": np.uint64,
    "chunk": np.int64,
    "row": np.int64,
    "priority": np.float64,
    "times_sampled": np.int64,
    "policy_version": np.int64,
    "inserted_at": np.float64,
    "group": np.int64,
    "group_size": np.int64,
    "task": np.int64,
    "reward": np.float64,
    # The table's count of inserts and priority updates at the item's last one: heap ties
    # go to the least recently touched item (Reverb's rule), and a restore replays it.
    "touched": np.int64,
    # A 64-bit hash of the row's episode (prompt_id, episode_id), 0: none; the ingest
    # check "extends" rebuilds its references from it after a restart.
    "episode": np.int64,
    # The row's data_version column (0 when the table has none or it is null): the task
    # mixture keeps a child per task and data version.
    "data_version": np.int64,
}


class ItemIndex:
    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = max(16, capacity)
        self.cols = {name: np.zeros(self.capacity, dtype=dt) for name, dt in COLUMNS.items()}
        self.live = np.zeros(self.capacity, dtype=bool)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # a stack: pop from the end
        self._num_free = self.capacity
        self.next_id = 1  # ids start at 1 so that 0 can mean "none" on the wire
        # Insertion log, ordered by id: (id, slot). Entries of removed items stay until
        # compaction; an entry is current iff live[slot] and id[slot] == its id.
        self._log_ids = np.zeros(self.capacity, dtype=np.uint64)
        self._log_slots = np.zeros(self.capacity, dtype=np.int64)
        self._log_len = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, column: str) -> np.ndarray:
        return self.cols[column]

    # -- mutation ---------------------------------------------------------------------

    def add(self, n: int, ids: np.ndarray | None = None, **values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Allocate n slots and ids, set the given columns; returns (slots, ids). A restore
        passes the ``ids`` it recorded (ascending, above every id so far)."""
        if n > self._num_free:
            self._grow(self._size + n)
        slots = self._free[self._num_free - n:self._num_free][::-1].copy()
        self._num_free -= n
        if ids is None:
            ids = np.arange(self.next_id, self.next_id + n, dtype=np.uint64)
        else:
            ids = np.asarray(ids, dtype=np.uint64)
        self.next_id = max(self.next_id, int(ids[-1]) + 1) if n else self.next_id
        cols = self.cols
        for name in COLUMNS:
            cols[name][slots] = 0
        cols["id"][slots] = ids
        cols["reward"][slots] = np.nan
        for name, v in values.items():
            cols[name][slots] = v
        self.live[slots] = True
        self._size += n
        self._append_log(ids, slots)
        return slots, ids

    def remove(self, slots: np.ndarray) -> None:
        """Free live slots (no duplicates)."""
        if len(slots) == 0:
            return
        self.live[slots] = False
        self._free[self._num_free:self._num_free + len(slots)] = slots
        self._num_free += len(slots)
        self._size -= len(slots)
        if self._log_len > 64 and self._size < self._log_len // 2:
            self._compact_log()

    # -- queries ----------------------------------------------------------------------

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slots of the given ids; -1 where an id is not live. O(k log n)."""
        ids = np.asarray(ids, dtype=np.uint64)
        n = self._log_len
        if n == 0:
            return np.full(len(ids), -1, dtype=np.int64)
        log_ids = self._log_ids[:n]
        pos = np.minimum(np.searchsorted(log_ids, ids), n - 1)
        slots = self._log_slots[pos]
        ok = (log_ids[pos] == ids) & self.live[slots] & (self.cols["id"][slots] == ids)
        return np.where(ok, slots, -1)

    def is_live(self, ids: np.ndarray) -> np.ndarray:
        """bool per id: whether its item is live. O(k log n)."""
        return self.lookup(ids) >= 0

    def live_slots(self) -> np.ndarray:
        """All live slots, in id order."""
        return self.slots_from(0, self._size)

    def count_from(self, first_id: int) -> int:
        """Live items with id >= first_id (a consumer group's lag): vectorised over the
        log entries from there on."""
        start = int(np.searchsorted(self._log_ids[:self._log_len], np.uint64(first_id)))
        s = self._log_slots[start:self._log_len]
        return int((self.live[s] & (self.cols["id"][s] == self._log_ids[start:self._log_len])).sum())

    def slots_from(self, first_id: int, limit: int) -> np.ndarray:
        """Up to ``limit`` live slots with id >= first_id, in id order."""
        start = int(np.searchsorted(self._log_ids[:self._log_len], np.uint64(first_id)))
        out: list[np.ndarray] = []
        found = 0
        window = max(64, 2 * limit)
        while found < limit and start < self._log_len:
            stop = min(self._log_len, start + window)
            s = self._log_slots[start:stop]
            current = self.live[s] & (self.cols["id"][s] == self._log_ids[start:stop])
            s = s[current][: limit - found]
            out.append(s)
            found += len(s)
            start = stop
            window *= 2
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    # -- internals --------------------------------------------------------------------

    def _grow(self, needed: int) -> None:
        new_cap = self.capacity
        while new_cap < needed:
            new_cap *= 2
        for name, arr in self.cols.items():
            grown = np.zeros(new_cap, dtype=arr.dtype)
            grown[:self.capacity] = arr
            self.cols[name] = grown
        live = np.zeros(new_cap, dtype=bool)
        live[:self.capacity] = self.live
        self.live = live
        free = np.empty(new_cap, dtype=np.int64)
        free[:self._num_free] = self._free[:self._num_free]
        added = np.arange(new_cap - 1, self.capacity - 1, -1, dtype=np.int64)
        # New slots go below the existing free ones so that low slots are reused first.
        free[len(added):len(added) + self._num_free] = free[:self._num_free].copy()
        free[:len(added)] = added
        self._num_free += len(added)
        self._free = free
        self.capacity = new_cap

    def _append_log(self, ids: np.ndarray, slots: np.ndarray) -> None:
        end = self._log_len + len(ids)
        if end > len(self._log_ids):
            size = max(end, 2 * len(self._log_ids))
            self._log_ids = np.resize(self._log_ids, size)
            self._log_slots = np.resize(self._log_slots, size)
        self._log_ids[self._log_len:end] = ids
        self._log_slots[self._log_len:end] = slots
        self._log_len = end

    def _compact_log(self) -> None:
        s = self._log_slots[:self._log_len]
        i = self._log_ids[:self._log_len]
        keep = self.live[s] & (self.cols["id"][s] == i)
        n = int(keep.sum())
        self._log_ids[:n] = i[keep]
        self._log_slots[:n] = s[keep]
        self._log_len = n
