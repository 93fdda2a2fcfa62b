"""The idempotency keys' removal window: against the simplest model of it (an ordered dict
of the keys that left, oldest first, trimmed to ``window``: what keys.py kept before it
held one dict of known keys and a FIFO of the removed ones) through random inserts and
removals, snapshots and restores; and as the journal packs it."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from expstore import journal
from expstore.keys import KeyRegistry


class Model:
    def __init__(self, window: int) -> None:
        self.window, self.live, self.removed = window, {}, OrderedDict()

    def remove(self, keys: list[str], ids: list[int], remember: bool) -> None:
        for key, item_id in zip(keys, ids):
            del self.live[key]
            if self.window and remember:
                self.removed[key] = item_id
        while len(self.removed) > self.window:
            self.removed.popitem(last=False)

    def lookup(self, key: str) -> int:
        return self.live.get(key, self.removed.get(key, 0))


# An operation: insert n new keys, or remove (remembered or not) some of the live ones.
OPS = st.lists(st.one_of(st.tuples(st.just("insert"), st.integers(0, 6)),
                         st.tuples(st.just("remove"), st.lists(st.integers(0, 1000), min_size=1, max_size=6),
                                   st.booleans())),
               max_size=40)


def snapshot(keys: KeyRegistry) -> dict:
    """The removal window of ``keys`` packed and unpacked as the journal does."""
    removed_keys, removed_ids = keys.removed()
    _, fields = journal.unpack(journal.pack("snapshot", {"removed_keys": removed_keys, "removed_ids": removed_ids}))
    return fields


def restored(keys: KeyRegistry, live: dict[int, tuple[str, int]]) -> KeyRegistry:
    """A new registry from a snapshot of ``keys``, and the live keys."""
    fields = snapshot(keys)
    again = KeyRegistry(keys.window, keys.seal_keys)
    slots = np.array(sorted(live), dtype=np.int64)
    again.add(slots, [live[s][0] for s in slots.tolist()], np.array([live[s][1] for s in slots.tolist()], np.uint64))
    again.restore_removed(fields["removed_keys"], fields["removed_ids"])
    return again


@settings(max_examples=150, deadline=None)
@given(window=st.sampled_from([0, 1, 3, 10, 50]), seal_keys=st.sampled_from([1, 2, 5, 4096]), ops=OPS,
       restore_at=st.integers(0, 40))
def test_window_matches_an_ordered_dict_trimmed_oldest_first(window, seal_keys, ops, restore_at):
    keys, model = KeyRegistry(window, seal_keys), Model(window)
    live: dict[int, tuple[str, int]] = {}  # slot -> (key, id)
    next_id = 1
    for step, op in enumerate(ops):
        if step == restore_at:
            keys = restored(keys, live)
        if op[0] == "insert":
            new = [(next_id + i, f"k{next_id + i}") for i in range(op[1])]
            slots = np.array([i for i, _ in new], dtype=np.int64)  # slot = id: never reused
            keys.add(slots, [k for _, k in new], slots.astype(np.uint64))
            for i, k in new:
                live[i], model.live[k] = (k, i), i
            next_id += op[1]
        elif live:
            picked = sorted({sorted(live)[j % len(live)] for j in op[1]})
            keys.remove(np.array(picked, dtype=np.int64), np.array([live[s][1] for s in picked], np.uint64),
                        remember=op[2])
            model.remove([live[s][0] for s in picked], [live[s][1] for s in picked], op[2])
            for s in picked:
                del live[s]
        removed_keys, removed_ids = keys.removed()
        assert removed_keys.to_pylist() == list(model.removed)
        assert removed_ids.tolist() == list(model.removed.values())
        probes = [f"k{i}" for i in range(next_id + 1)]
        assert keys.lookup(probes).tolist() == [model.lookup(p) for p in probes]


def test_keys_are_remembered_for_a_window_of_removals():
    keys = KeyRegistry(window=2)
    keys.add(np.array([0, 1, 2]), ["a", "b", "c"], np.array([1, 2, 3], dtype=np.uint64))
    assert keys.lookup(["a", "x", "c"]).tolist() == [1, 0, 3]
    keys.remove(np.array([0, 1, 2]), np.array([1, 2, 3], dtype=np.uint64))
    assert keys.lookup(["a", "b", "c"]).tolist() == [0, 2, 3]  # "a" fell out of the window
    keys.add(np.array([0]), ["a"], np.array([4], dtype=np.uint64))  # slot reuse
    assert keys.lookup(["a"]).tolist() == [4]


def test_a_snapshot_of_a_trimmed_window_packs_only_what_it_remembers():
    keys = KeyRegistry(window=3, seal_keys=2)
    keys.add(np.arange(5), [f"k{i}" for i in range(5)], np.arange(1, 6, dtype=np.uint64))
    keys.remove(np.arange(5), np.arange(1, 6, dtype=np.uint64))  # k0 and k1 forgotten at once
    fields = snapshot(keys)
    assert fields["removed_keys"] == ["k2", "k3", "k4"]
    assert fields["removed_ids"].tolist() == [3, 4, 5]


def test_the_journal_packs_a_slice_of_an_arrow_string_array_as_its_own_strings():
    whole = pa.array(["ab", "c", "", "def", "g"], pa.string())
    chunked = pa.chunked_array([whole.slice(3), whole.slice(0, 2)])
    for part in (whole.slice(2), whole.slice(1, 3), whole.slice(0, 0), chunked):
        _, fields = journal.unpack(journal.pack("x", {"s": part}))
        assert fields["s"] == part.to_pylist()
    _, fields = journal.unpack(journal.pack("x", {"s": pa.array(["a", None])}))  # nulls: kept as JSON
    assert fields["s"] == ["a", None]
