"""ItemIndex: ids, slots, lookup, slot reuse, growth and id-ordered scans, checked against
a plain dict model by a hypothesis state machine, plus a few exact cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from expstore.index import COLUMNS, ItemIndex


def add(ix: ItemIndex, n: int, priority_base: float = 0.0):
    return ix.add(n, priority=np.arange(n, dtype=np.float64) + priority_base,
                  policy_version=np.full(n, 7, dtype=np.int64))


# --- exact cases ----------------------------------------------------------------------

def test_ids_start_at_one_and_are_monotonic():
    ix = ItemIndex(capacity=16)
    s1, i1 = add(ix, 3)
    s2, i2 = add(ix, 2)
    assert i1.tolist() == [1, 2, 3] and i2.tolist() == [4, 5]
    assert i1.dtype == np.uint64
    assert len(set(s1.tolist() + s2.tolist())) == 5
    assert len(ix) == 5 and ix.next_id == 6


def test_add_sets_given_columns_and_defaults_the_rest():
    ix = ItemIndex(capacity=16)
    slots, ids = ix.add(2, priority=np.array([0.5, 2.0]), chunk=np.array([3, 4]))
    assert ix["priority"][slots].tolist() == [0.5, 2.0]
    assert ix["chunk"][slots].tolist() == [3, 4]
    assert ix["id"][slots].tolist() == ids.tolist()
    assert ix["times_sampled"][slots].tolist() == [0, 0]
    assert np.isnan(ix["reward"][slots]).all()


def test_reused_slot_does_not_inherit_old_values():
    ix = ItemIndex(capacity=16)
    slots, _ = ix.add(16, priority=np.full(16, 9.0), reward=np.full(16, 1.0))
    ix["times_sampled"][slots] = 5
    ix.remove(slots[:4])
    new, ids = ix.add(4)
    assert sorted(new.tolist()) == sorted(slots[:4].tolist())  # reused, no growth
    assert ix.capacity == 16
    assert ix["priority"][new].tolist() == [0.0] * 4
    assert ix["times_sampled"][new].tolist() == [0] * 4
    assert np.isnan(ix["reward"][new]).all()
    assert ids.tolist() == [17, 18, 19, 20]


def test_lookup_unknown_removed_and_reused():
    ix = ItemIndex(capacity=16)
    slots, ids = add(ix, 4)
    ix.remove(slots[1:2])  # id 2
    new_slots, new_ids = add(ix, 1)  # reuses id 2's slot
    assert new_slots.tolist() == [slots[1]]
    got = ix.lookup(np.array([1, 2, 3, 4, 5, 0, 99], dtype=np.uint64))
    assert got.tolist() == [slots[0], -1, slots[2], slots[3], slots[1], -1, -1]
    assert ItemIndex().lookup(np.array([1], dtype=np.uint64)).tolist() == [-1]


def test_growth_keeps_values_and_lookups():
    ix = ItemIndex(capacity=16)
    slots, ids = add(ix, 10, priority_base=100)
    more, more_ids = add(ix, 40)
    assert ix.capacity >= 50
    assert ix.lookup(ids).tolist() == slots.tolist()
    assert ix["priority"][ix.lookup(ids)].tolist() == list(np.arange(10) + 100.0)
    assert ix.lookup(more_ids).tolist() == more.tolist()
    assert len(set(slots.tolist() + more.tolist())) == 50


def test_slots_from_skips_removed_and_honours_limit():
    ix = ItemIndex(capacity=16)
    slots, ids = add(ix, 10)
    ix.remove(slots[[0, 3, 4, 9]])  # ids 1, 4, 5, 10
    assert ix["id"][ix.slots_from(1, 100)].tolist() == [2, 3, 6, 7, 8, 9]
    assert ix["id"][ix.slots_from(4, 2)].tolist() == [6, 7]
    assert ix["id"][ix.slots_from(10, 5)].tolist() == []
    assert ix["id"][ix.slots_from(11, 5)].tolist() == []
    assert ix.slots_from(1, 0).tolist() == []
    assert ix["id"][ix.live_slots()].tolist() == [2, 3, 6, 7, 8, 9]


def test_slots_from_spans_sparse_log():
    ix = ItemIndex(capacity=16)
    slots, ids = add(ix, 100)
    ix.remove(slots[:49])  # 51 of 100 logged entries live: not compacted yet
    assert len(ix) == 51
    for first, limit in ((0, 40), (0, 51), (0, 60), (30, 45), (50, 3), (99, 10)):
        want = [i for i in ids.tolist() if i >= max(first, 50)][:limit]
        assert ix["id"][ix.slots_from(first, limit)].tolist() == want, (first, limit)


def test_many_removals_compact_without_losing_items():
    ix = ItemIndex(capacity=16)
    slots, ids = add(ix, 300)
    keep = ids % 7 == 0
    ix.remove(slots[~keep])
    assert len(ix) == int(keep.sum())
    assert ix.lookup(ids[keep]).tolist() == slots[keep].tolist()
    assert (ix.lookup(ids[~keep]) == -1).all()
    assert ix["id"][ix.live_slots()].tolist() == ids[keep].tolist()
    _, later = add(ix, 3)
    assert later.tolist() == [301, 302, 303]


# --- model-based ----------------------------------------------------------------------

class IndexMachine(RuleBasedStateMachine):
    """Model: id -> (slot, priority) of live items; ``next_id``; removed ids."""

    @initialize(capacity=st.sampled_from([1, 16, 20]))
    def start(self, capacity):
        self.ix = ItemIndex(capacity=capacity)
        self.model: dict[int, tuple[int, float]] = {}
        self.removed: set[int] = set()
        self.next_id = 1
        self.counter = 0.0

    @rule(n=st.integers(0, 40))
    def add(self, n):
        cap, size = self.ix.capacity, len(self.ix)
        pr = np.arange(n, dtype=np.float64) + self.counter
        self.counter += n
        slots, ids = self.ix.add(n, priority=pr)
        assert ids.tolist() == list(range(self.next_id, self.next_id + n))
        self.next_id += n
        assert len(set(slots.tolist())) == n
        live_slots = {s for s, _ in self.model.values()}
        assert not live_slots & set(slots.tolist()), "a live slot was handed out again"
        assert all(0 <= s < self.ix.capacity for s in slots.tolist())
        if size + n <= cap:
            assert self.ix.capacity == cap, "grew although free slots were enough"
        for i, s, p in zip(ids.tolist(), slots.tolist(), pr.tolist()):
            self.model[i] = (s, p)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True, min_size=1))
        slots = np.array([self.model[i][0] for i in ids], dtype=np.int64)
        self.ix.remove(slots)
        for i in ids:
            del self.model[i]
            self.removed.add(i)

    @rule(data=st.data())
    def lookup(self, data):
        pool = sorted(self.model) + sorted(self.removed) + [0, self.next_id, self.next_id + 3]
        ids = data.draw(st.lists(st.sampled_from(pool), max_size=20))
        got = self.ix.lookup(np.array(ids, dtype=np.uint64)).tolist()
        assert got == [self.model[i][0] if i in self.model else -1 for i in ids]

    @rule(first=st.integers(0, 200), limit=st.integers(0, 50))
    def slots_from(self, first, limit):
        got = self.ix.slots_from(first, limit).tolist()
        want = [self.model[i][0] for i in sorted(self.model) if i >= first][:limit]
        assert got == want

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "ix"):
            return
        assert len(self.ix) == len(self.model)
        assert int(self.ix.live.sum()) == len(self.model)
        assert self.ix.next_id == self.next_id
        ordered = sorted(self.model)
        assert self.ix.live_slots().tolist() == [self.model[i][0] for i in ordered]
        slots = np.array([self.model[i][0] for i in ordered], dtype=np.int64)
        assert self.ix["id"][slots].tolist() == ordered
        assert self.ix["priority"][slots].tolist() == [self.model[i][1] for i in ordered]
        for name in COLUMNS:
            assert len(self.ix[name]) == self.ix.capacity


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestItemIndex = IndexMachine.TestCase


@pytest.mark.parametrize("capacity", [0, 1, 15])
def test_capacity_has_a_floor(capacity):
    ix = ItemIndex(capacity=capacity)
    assert ix.capacity >= 16
    slots, _ = add(ix, 17)
    assert ix.capacity >= 17 and len(set(slots.tolist())) == 17
