"""Samplers and removers: distributions (chi-square), exact orders, groups, mixing, errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from expstore.errors import FailedPrecondition, InvalidArgument
from expstore.samplers import (Codebook, Fifo, GroupSampler, Items, Lifo, MaxHeap, MinHeap,
                               Prioritized, Selector, TaskMixture, Uniform, make_remover, make_sampler)
from expstore.spec import SamplerSpec

P_MIN = 1e-3


def items(slots, ids=None, priorities=None, groups=None, tasks=None, rewards=None, group_sizes=None) -> Items:
    slots = np.asarray(slots, dtype=np.int64)
    k = len(slots)

    def col(v, default, dtype):
        return np.full(k, default, dtype=dtype) if v is None else np.asarray(v, dtype=dtype)

    return Items(slots=slots, ids=col(ids if ids is not None else slots + 1, 0, np.uint64),
                 priorities=col(priorities, 1.0, np.float64), groups=col(groups, -1, np.int64),
                 group_sizes=col(group_sizes, 0, np.int64), tasks=col(tasks, -1, np.int64),
                 rewards=col(rewards, np.nan, np.float64))


class Pool:
    """A stand-in for the table: reuses the lowest free slot, ids are monotonic;
    ``touched`` counts inserts and priority updates (the heaps' tie order)."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.next_slot = 0
        self.next_id = 1
        self.touches = 0
        self.live: dict[int, dict] = {}  # slot -> {"id", "priority", "touched", ...}

    def touch(self) -> int:
        self.touches += 1
        return self.touches

    def new(self, k: int, **cols) -> Items:
        slots = []
        for _ in range(k):
            if self.free:
                self.free.sort()
                slots.append(self.free.pop(0))
            else:
                slots.append(self.next_slot)
                self.next_slot += 1
        ids = list(range(self.next_id, self.next_id + k))
        self.next_id += k
        it = items(slots, ids=ids, **cols)
        for j, s in enumerate(slots):
            self.live[s] = {"id": ids[j], "priority": float(it.priorities[j]), "group": int(it.groups[j]),
                            "touched": self.touch()}
        return it

    def drop(self, slots) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64)
        for s in slots.tolist():
            del self.live[s]
            self.free.append(s)
        return slots


def counts_of(slots, n_slots):
    return np.bincount(np.asarray(slots), minlength=n_slots)


# ---------------------------------------------------------------- uniform

def test_uniform_chisquare_after_removals_and_reuse():
    u = Uniform()
    u.insert(items(np.arange(50)))
    u.remove(np.array([0, 7, 49, 20, 21]))
    u.insert(items(np.array([7, 60])))  # slot 7 reused; 60 beyond anything seen (growth)
    held = sorted(set(range(50)) - {0, 7, 49, 20, 21} | {7, 60})
    assert len(u) == len(held) and sorted(u.slots.tolist()) == held
    n = 60_000
    sel = u.sample(n, np.random.default_rng(0))
    assert set(sel.slots.tolist()) == set(held)
    c = counts_of(sel.slots, 61)[held]
    assert chisquare(c).pvalue > P_MIN
    np.testing.assert_allclose(sel.probabilities, 1 / len(held))
    np.testing.assert_array_equal(sel.weights, 1.0)


def test_uniform_swap_remove_any_subset():
    rng = np.random.default_rng(5)
    u = Uniform()
    u.insert(items(np.arange(1000)))
    held = set(range(1000))
    for _ in range(20):
        victims = rng.choice(sorted(held), size=min(len(held), 37), replace=False)
        u.remove(victims)
        held -= set(victims.tolist())
        assert sorted(u.slots.tolist()) == sorted(held)
        assert all(s in u for s in list(held)[:5]) and all(s not in u for s in victims[:5].tolist())


def test_uniform_empty_and_zero():
    u = Uniform()
    assert not u.can_sample(1) and u.can_sample(0)
    with pytest.raises(FailedPrecondition):
        u.sample(1, np.random.default_rng(0))
    assert len(u.sample(0, np.random.default_rng(0)).slots) == 0
    with pytest.raises(InvalidArgument):
        u.sample(-1, np.random.default_rng(0))
    assert len(u.rejected()) == 0 and u.rejected().dtype == np.int64


# ---------------------------------------------------------------- prioritized

@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_prioritized_chisquare_and_weights(alpha):
    beta = 0.4
    pr = np.array([0.0, 1.0, 2.0, 3.0, 0.5, 10.0, 4.0, 0.25])
    s = Prioritized(alpha=alpha, beta=beta, capacity=2)  # grows
    s.insert(items(np.arange(len(pr)), priorities=pr))
    weight = np.where(pr > 0, pr ** alpha, 0.0)  # priority 0 weighs 0, at alpha 0 too (Reverb)
    expected = weight / weight.sum()
    n = 50_000
    sel = s.sample(n, np.random.default_rng(11))
    c = counts_of(sel.slots, len(pr))
    nz = expected > 0
    assert c[~nz].sum() == 0
    assert chisquare(c[nz], n * expected[nz]).pvalue > P_MIN
    np.testing.assert_allclose(sel.probabilities, expected[sel.slots], rtol=1e-12)
    w = (len(pr) * sel.probabilities) ** -beta
    np.testing.assert_allclose(sel.weights, w / w.max(), rtol=1e-12)
    assert sel.weights.max() == 1.0
    np.testing.assert_allclose(s.probabilities(np.arange(len(pr))), expected, rtol=1e-12)


def test_prioritized_update_remove_and_reuse():
    s = Prioritized(alpha=1.0, beta=0.0)
    s.insert(items(np.arange(4), priorities=[1.0, 1.0, 1.0, 1.0]))
    s.update(np.array([0, 3]), np.array([0.0, 7.0]))
    s.remove(np.array([1]))
    s.insert(items(np.array([1, 2000]), ids=[10, 11], priorities=[2.0, 0.0]))  # reuse, grow
    assert len(s) == 5
    expected = {1: 2 / 10, 2: 1 / 10, 3: 7 / 10}
    n = 30_000
    sel = s.sample(n, np.random.default_rng(4))
    assert set(sel.slots.tolist()) == set(expected)
    c = counts_of(sel.slots, 4)[[1, 2, 3]]
    assert chisquare(c, n * np.array([0.2, 0.1, 0.7])).pvalue > P_MIN
    np.testing.assert_array_equal(sel.weights, 1.0)


def test_prioritized_all_zero_falls_back_to_uniform():
    s = Prioritized(alpha=0.6, beta=1.0)
    s.insert(items(np.arange(5), priorities=np.zeros(5)))
    n = 20_000
    sel = s.sample(n, np.random.default_rng(8))
    assert chisquare(counts_of(sel.slots, 5)).pvalue > P_MIN
    np.testing.assert_allclose(sel.probabilities, 0.2)
    np.testing.assert_array_equal(sel.weights, 1.0)
    s.update(np.array([2]), np.array([1.0]))
    assert set(s.sample(100, np.random.default_rng(0)).slots.tolist()) == {2}


def test_prioritized_alpha_zero_is_uniform_over_nonzero_priorities():
    """Priority 0 is how a user excludes an item: never drawn at alpha 0 either (where
    0 ** 0 = 1 would make it as likely as any); all-zero falls back to uniform (Reverb)."""
    s = Prioritized(alpha=0.0, beta=1.0)
    s.insert(items(np.arange(5), priorities=[0.0, 5.0, 0.0, 0.5, 2.0]))
    n = 30_000
    sel = s.sample(n, np.random.default_rng(0))
    c = counts_of(sel.slots, 5)
    assert c[0] == 0 and c[2] == 0
    assert chisquare(c[[1, 3, 4]]).pvalue > P_MIN
    np.testing.assert_array_equal(sel.probabilities, 1 / 3)
    np.testing.assert_array_equal(sel.weights, 1.0)
    assert s.stats()["total_priority"] == 3.0
    s.update(np.array([1, 3, 4]), np.zeros(3))
    sel = s.sample(n, np.random.default_rng(1))
    assert chisquare(counts_of(sel.slots, 5)).pvalue > P_MIN
    np.testing.assert_array_equal(sel.probabilities, 0.2)


def test_prioritized_errors():
    s = Prioritized(alpha=2.0)
    with pytest.raises(FailedPrecondition):
        s.sample(1, np.random.default_rng(0))
    with pytest.raises(InvalidArgument):
        s.insert(items([0], priorities=[1e200]))  # overflows p ** alpha
    with pytest.raises(InvalidArgument):
        Prioritized(alpha=-1.0)


# ---------------------------------------------------------------- fifo / lifo

def test_fifo_lifo_exact_order_with_removals_and_slot_reuse():
    for cls, newest in ((Fifo, False), (Lifo, True)):
        pool, s = Pool(), cls()
        s.insert(pool.new(6))          # slots 0..5, ids 1..6
        s.remove(pool.drop([0, 3]))
        s.insert(pool.new(2))          # reuses slots 0 and 3 with ids 7, 8: the newest
        expected = sorted(pool.live, key=lambda x: pool.live[x]["id"], reverse=newest)
        assert expected == ([3, 0, 5, 4, 2, 1] if newest else [1, 2, 4, 5, 0, 3])
        sel = s.sample(6)
        assert sel.slots.tolist() == expected
        np.testing.assert_array_equal(sel.probabilities, 1.0)
        assert s.sample(2, np.random.default_rng(0)).slots.tolist() == expected[:2]
        assert s.can_sample(6) and not s.can_sample(7)
        with pytest.raises(FailedPrecondition):
            s.sample(7)
        s.update(np.array([1]), np.array([100.0]))  # order is by id only
        assert s.sample(6).slots.tolist() == expected


def test_fifo_out_of_order_batch_is_sorted_by_id():
    s = Fifo()
    s.insert(items([0, 1], ids=[5, 9]))
    s.insert(items([2, 3, 4], ids=[7, 3, 11]))
    assert s.sample(5).slots.tolist() == [3, 0, 2, 1, 4]
    assert Lifo().sample(0).slots.tolist() == []


def test_fifo_many_removals_compaction():
    s, pool = Fifo(), Pool()
    rng = np.random.default_rng(0)
    for _ in range(50):
        s.insert(pool.new(100))
        held = np.array(sorted(pool.live))
        s.remove(pool.drop(rng.choice(held, size=90, replace=False)))
        expected = sorted(pool.live, key=lambda x: pool.live[x]["id"])
        assert s.sample(len(expected)).slots.tolist() == expected
    assert len(s._slot) < 4096  # compaction keeps the log near the live count


# ---------------------------------------------------------------- heaps

def test_heaps_order_ties_updates_and_reuse():
    pool = Pool()
    batch = pool.new(6, priorities=[3.0, 1.0, 3.0, 5.0, 1.0, 0.0])  # slots 0..5
    mx, mn = MaxHeap(), MinHeap()
    for h in (mx, mn):
        h.insert(batch)
    assert mx.sample(6).slots.tolist() == [3, 0, 2, 1, 4, 5]
    assert mn.sample(6).slots.tolist() == [5, 1, 4, 0, 2, 3]
    assert mx.sample(6).slots.tolist() == [3, 0, 2, 1, 4, 5]  # sampling does not consume
    gone = pool.drop([0])
    for h in (mx, mn):
        h.update(np.array([5, 3]), np.array([4.0, 1.0]))
        h.remove(gone)
    nb = pool.new(1, priorities=[3.0])  # reuses slot 0, id 7: newer than slot 2
    for h in (mx, mn):
        h.insert(nb)
    assert mx.sample(6).slots.tolist() == [5, 2, 0, 1, 4, 3]  # slot 3 updated to 1.0: behind 1 and 4
    assert mn.sample(3).slots.tolist() == [1, 4, 3]
    assert mx.priorities(np.array([5, 0])).tolist() == [4.0, 3.0]
    with pytest.raises(FailedPrecondition):
        mx.sample(7)
    mx.update(np.array([1]), np.array([9.0]))
    mx.remove(np.array([1]))
    mx.update(np.array([1]), np.array([9.0]))  # not held: ignored, never resurrected
    assert 1 not in mx.sample(5).slots.tolist() and len(mx) == 5


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "remove", "update"]), st.integers(1, 30),
                          st.integers(0, 2**31)), min_size=1, max_size=30))
def test_ordered_and_heaps_match_a_reference_model(ops):
    pool = Pool()
    sels = {"fifo": Fifo(), "lifo": Lifo(), "max": MaxHeap(), "min": MinHeap(),
            "uniform": Uniform(), "prio": Prioritized(0.6, 0.4, capacity=1),
            "mix": TaskMixture({"t0": 1.0, "*": 2.0}, codebook("t0", "t1"), Lifo)}
    for op, k, seed in ops:
        rng = np.random.default_rng(seed)
        if op == "insert":
            batch = pool.new(k, priorities=rng.integers(0, 4, k).astype(float), tasks=rng.integers(-1, 2, k))
            for s in sels.values():
                s.insert(batch)
        elif pool.live:
            victims = rng.choice(sorted(pool.live), size=min(k, len(pool.live)), replace=False)
            if op == "remove":
                pool.drop(victims)
                for s in sels.values():
                    s.remove(victims)
            else:
                prio = rng.integers(0, 4, len(victims)).astype(float)
                for v, p in zip(victims.tolist(), prio.tolist()):
                    pool.live[v].update(priority=p, touched=pool.touch())
                for s in sels.values():
                    s.update(victims, prio)
        live = pool.live
        for s in sels.values():
            assert len(s) == len(live)
        by_id = sorted(live, key=lambda x: live[x]["id"])
        assert sels["fifo"].sample(len(live)).slots.tolist() == by_id
        assert sels["lifo"].sample(len(live)).slots.tolist() == by_id[::-1]
        assert sels["max"].sample(len(live)).slots.tolist() == sorted(
            live, key=lambda x: (-live[x]["priority"], live[x]["touched"]))
        assert sels["min"].sample(len(live)).slots.tolist() == sorted(
            live, key=lambda x: (live[x]["priority"], live[x]["touched"]))
        mixed = sels["mix"].sample(len(live), rng).slots.tolist()
        assert sorted(mixed) == sorted(live)
        if live:
            assert set(sels["uniform"].sample(20, rng).slots.tolist()) <= set(live)
            got = sels["prio"].sample(20, rng).slots.tolist()
            assert set(got) <= set(live)
            if any(live[x]["priority"] > 0 for x in live):
                assert all(live[x]["priority"] > 0 for x in got)


def test_heap_ties_go_to_the_least_recently_inserted_or_updated():
    """Reverb's HeapSelector: an update, even to the same priority, sends an item behind
    its equals, so equal items rotate; within one call, in the order given."""
    for h in (MaxHeap(), MinHeap()):
        h.insert(items([0, 1, 2, 3], priorities=[2.0] * 4))
        assert h.sample(4).slots.tolist() == [0, 1, 2, 3]
        h.update(np.array([0]), np.array([2.0]))
        assert h.sample(4).slots.tolist() == [1, 2, 3, 0]
        h.update(np.array([2, 1]), np.array([2.0, 2.0]))
        assert h.sample(4).slots.tolist() == [3, 0, 2, 1]
        rotation = []
        for _ in range(8):  # take the head, give it back with the same priority
            head = h.sample(1).slots
            rotation += head.tolist()
            h.update(head, np.array([2.0]))
        assert rotation == [3, 0, 2, 1, 3, 0, 2, 1]


# ---------------------------------------------------------------- group

def test_group_only_complete_groups_contiguous():
    g = GroupSampler(group_size=3)
    g.insert(items([0, 1, 2, 3, 4], ids=[1, 2, 3, 4, 5], groups=[0, 1, 0, 1, 0]))
    assert g.complete_groups == 1 and not g.can_sample(6) and g.can_sample(3)
    sel = g.sample(3, np.random.default_rng(0))
    assert sel.slots.tolist() == [0, 2, 4]
    g.insert(items([5, 6], ids=[6, 7], groups=[1, -1]))
    assert len(g) == 7 and g.complete_groups == 2
    sel = g.sample(6, np.random.default_rng(1))
    blocks = sorted(tuple(b) for b in sel.slots.reshape(2, 3).tolist())
    assert blocks == [(0, 2, 4), (1, 3, 5)]
    np.testing.assert_allclose(sel.probabilities, 0.5)
    with pytest.raises(InvalidArgument):
        g.sample(4, np.random.default_rng(0))
    with pytest.raises(FailedPrecondition):
        g.sample(9, np.random.default_rng(0))
    assert not g.can_sample(4)
    assert len(g.rejected()) == 0


def test_group_uniform_chisquare_over_complete_groups():
    g = GroupSampler(group_size=2)
    g.insert(items(np.arange(20), groups=np.arange(20) // 2))
    rng = np.random.default_rng(3)
    firsts = np.concatenate([g.sample(4, rng).slots.reshape(2, 2)[:, 0] for _ in range(5000)])
    assert len(set(firsts.tolist())) == 10
    assert chisquare(np.bincount(firsts // 2, minlength=10)).pvalue > P_MIN


def test_group_fifo_by_completion():
    g = GroupSampler(group_size=2, order="fifo")
    g.insert(items([0, 1, 2], ids=[1, 2, 3], groups=[7, 8, 9]))
    g.insert(items([3, 4], ids=[4, 5], groups=[9, 7]))   # 9 completes before 7
    g.insert(items([5], ids=[6], groups=[8]))
    sel = g.sample(6, np.random.default_rng(0))
    assert sel.slots.tolist() == [2, 3, 0, 4, 1, 5]
    np.testing.assert_array_equal(sel.probabilities, 1.0)
    g.remove(np.array([2]))  # group 9 breaks
    assert g.sample(4, np.random.default_rng(0)).slots.tolist() == [0, 4, 1, 5]
    assert len(g) == 5


def test_group_lifo_by_completion():
    g = GroupSampler(group_size=2, order="lifo")
    g.insert(items([0, 1, 2], ids=[1, 2, 3], groups=[7, 8, 9]))
    g.insert(items([3, 4], ids=[4, 5], groups=[9, 7]))   # 9 completes, then 7
    g.insert(items([5], ids=[6], groups=[8]))            # 8 completes last
    sel = g.sample(4, np.random.default_rng(0))
    assert sel.slots.tolist() == [1, 5, 0, 4]
    np.testing.assert_array_equal(sel.probabilities, 1.0)
    g.remove(np.array([1]))  # group 8 breaks
    assert g.sample(4, np.random.default_rng(0)).slots.tolist() == [0, 4, 2, 3]
    g.insert(items([6, 7], ids=[7, 8], groups=[10, 10]))  # the newest again
    assert g.sample(2, np.random.default_rng(0)).slots.tolist() == [6, 7]


def test_group_broken_extra_and_ungrouped():
    g = GroupSampler(group_size=2)
    g.insert(items([0, 1, 2], ids=[1, 2, 3], groups=[0, 0, 0]))  # 3rd member of 0: rejected
    assert g.rejected().tolist() == [2] and g.rejected().tolist() == []
    g.remove(np.array([2]))                                    # the table drops it
    assert g.complete_groups == 1
    g.insert(items([3, 4], ids=[4, 5], groups=[1, -1]))
    g.remove(np.array([3]))                                    # group 1 breaks while forming
    g.insert(items([3], ids=[6], groups=[1]))                  # later member: still broken
    assert g.complete_groups == 1
    g.remove(np.array([0]))                                    # complete group 0 breaks
    assert g.complete_groups == 0 and not g.can_sample(2)
    g.insert(items([0], ids=[7], groups=[0]))                  # 4th arrival of group 0
    assert g.rejected().tolist() == [0]
    assert len(g) == 4  # slots 0 (rejected, held until removed), 1, 3, 4


def test_group_drop_zero_variance():
    g = GroupSampler(group_size=2, drop_zero_variance=True)
    g.insert(items(np.arange(8), groups=[0, 0, 1, 1, 2, 2, 3, 3],
                   rewards=[1.0, 1.0, 0.0, 1.0, np.nan, np.nan, 0.5, np.nan]))
    assert sorted(g.rejected().tolist()) == [0, 1]
    assert g.complete_groups == 3
    g.remove(np.array([0, 1]))
    assert g.complete_groups == 3 and len(g) == 6
    g.insert(items([0, 1, 20], ids=[100, 101, 102], groups=[4, 5, 5], rewards=[2.0, 3.0, 3.0]))
    assert sorted(g.rejected().tolist()) == [1, 20]
    keep = GroupSampler(group_size=2, drop_zero_variance=False)
    keep.insert(items([0, 1], groups=[0, 0], rewards=[1.0, 1.0]))
    assert keep.complete_groups == 1 and len(keep.rejected()) == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.booleans(), st.sampled_from(["uniform", "fifo", "lifo"]),
       st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 2**31)),
                min_size=1, max_size=25))
def test_group_never_partial_property(size, drop, order, ops):
    g = GroupSampler(group_size=size, drop_zero_variance=drop, order=order)
    pool = Pool()
    arrivals: dict[int, int] = {}
    broken: set[int] = set()
    for is_insert, k, seed in ops:
        rng = np.random.default_rng(seed)
        if is_insert:
            codes = rng.integers(-1, 6 + len(arrivals) // 3, size=k)
            batch = pool.new(k, groups=codes, rewards=rng.integers(0, 2, size=k).astype(float))
            g.insert(batch)
            for c in codes.tolist():
                arrivals[c] = arrivals.get(c, 0) + 1
            rejected = g.rejected()
            if len(rejected):
                g.remove(pool.drop(rejected))
        elif pool.live:
            victims = rng.choice(sorted(pool.live), size=min(k, len(pool.live)), replace=False)
            broken |= {pool.live[v]["group"] for v in victims.tolist()}
            g.remove(pool.drop(victims))
        assert len(g) == len(pool.live)
        members: dict[int, list[int]] = {}
        for s, row in pool.live.items():
            members.setdefault(row["group"], []).append(s)
        m = g.complete_groups
        assert g.can_sample(m * size) and not g.can_sample((m + 1) * size)
        sel = g.sample(m * size, rng)
        assert len(set(sel.slots.tolist())) == m * size
        for block in sel.slots.reshape(m, size).tolist():
            code = pool.live[block[0]]["group"]
            assert code >= 0 and code not in broken
            assert sorted(block) == sorted(members[code]) and len(members[code]) == size
        # every live complete, unbroken group with unequal rewards (or drop off) is eligible
        eligible = [c for c, ss in members.items()
                    if c >= 0 and c not in broken and len(ss) == size and arrivals[c] >= size]
        assert m == len(eligible)


# ---------------------------------------------------------------- task mixture

def codebook(*names: str) -> Codebook:
    cb = Codebook()
    cb.encode(pa.array(list(names)))
    return cb


def test_mixture_ratios_chisquare_and_probabilities():
    cb = codebook("math", "code", "chat", "unlisted")
    mix = TaskMixture({"math": 0.5, "code": 0.3, "chat": 0.0, "*": 0.2}, cb, Uniform)
    tasks = np.repeat([0, 1, 2, 3, -1], [10, 5, 7, 3, 2])
    mix.insert(items(np.arange(len(tasks)), tasks=tasks))
    assert len(mix) == 27
    rng = np.random.default_rng(9)
    n, rounds = 64, 400
    per_task = np.zeros(5)
    for _ in range(rounds):
        sel = mix.sample(n, rng)
        t = tasks[sel.slots]
        assert not np.any(t == 2)  # zero weight: never sampled
        per_task += np.bincount(np.where(t < 0, 4, t), minlength=5)
    q = np.array([0.5, 0.3, 0.0, 0.2, 0.2]) / 1.2
    nz = q > 0
    assert chisquare(per_task[nz], n * rounds * q[nz]).pvalue > P_MIN
    sel = mix.sample(n, rng)
    t = tasks[sel.slots]
    sizes = {0: 10, 1: 5, 3: 3, -1: 2}
    qmap = {0: q[0], 1: q[1], 3: q[3], -1: q[4]}
    np.testing.assert_allclose(sel.probabilities, [qmap[x] / sizes[x] for x in t.tolist()])
    mix.remove(np.arange(10))  # math leaves: renormalise over the rest
    t = tasks[mix.sample(2000, rng).slots]
    assert not np.any((t == 0) | (t == 2))


def test_mixture_caps_distinct_children_and_redistributes():
    cb = codebook("a", "b")
    mix = TaskMixture({"a": 0.9, "b": 0.1}, cb, Fifo)
    mix.insert(items(np.arange(6), tasks=[0, 0, 1, 1, 1, 1]))
    rng = np.random.default_rng(0)
    from_a = []
    for _ in range(50):
        sel = mix.sample(5, rng)  # a can give only 2: the excess is redrawn from b
        got = sel.slots.tolist()
        assert len(set(got)) == 5
        a, b = [x for x in got if x < 2], [x for x in got if x >= 2]
        assert a == [0, 1][:len(a)] and b == [2, 3, 4, 5][:len(b)]  # each child in fifo order
        from_a.append(len(a))
    assert np.mean(np.array(from_a) == 2) > 0.9
    assert mix.can_sample(6) and not mix.can_sample(7)
    with pytest.raises(FailedPrecondition):
        mix.sample(7, rng)
    empty = TaskMixture({"a": 1.0}, cb, Uniform)
    with pytest.raises(FailedPrecondition):
        empty.sample(1, rng)
    empty.insert(items([0], tasks=[1]))  # only b, weight 0 (no "*")
    assert len(empty) == 1 and not empty.can_sample(1)


def test_mixture_of_groups_and_rejected_forwarding():
    cb = codebook("a", "b")
    mix = TaskMixture({"*": 1.0}, cb, lambda: GroupSampler(2, drop_zero_variance=True), unit=2)
    mix.insert(items(np.arange(8), groups=[0, 0, 1, 1, 2, 2, 3, 3], tasks=[0, 0, 0, 0, 1, 1, 1, 1],
                     rewards=[0, 1, 5, 5, 0, 1, 0, 2]))
    assert mix.rejected().tolist() == [2, 3]
    mix.remove(np.array([2, 3]))
    with pytest.raises(InvalidArgument):
        mix.sample(3, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    for _ in range(20):
        sel = mix.sample(6, rng)
        blocks = sorted(tuple(sorted(b)) for b in sel.slots.reshape(3, 2).tolist())
        assert blocks == [(0, 1), (4, 5), (6, 7)]
    mix.update(np.array([0, 4]), np.array([1.0, 2.0]))  # routed, no-op for groups


def test_mixture_prioritized_children_pass_weights_through():
    cb = codebook("a", "b")
    mix = make_sampler(SamplerSpec(type="prioritized", alpha=1.0, beta=1.0, task_weights={"a": 1, "b": 1}), cb)
    mix.insert(items(np.arange(4), tasks=[0, 0, 1, 1], priorities=[1.0, 3.0, 1.0, 1.0]))
    sel = mix.sample(4000, np.random.default_rng(2))
    in_a = sel.slots < 2
    pa_ = np.where(sel.slots == 0, 0.25, 0.75)
    np.testing.assert_allclose(sel.probabilities[in_a], 0.5 * pa_[in_a])
    np.testing.assert_allclose(sel.probabilities[~in_a], 0.25)
    np.testing.assert_allclose(sel.weights[in_a & (sel.slots == 0)], 1.0)
    np.testing.assert_allclose(sel.weights[sel.slots == 1], 1 / 3)
    np.testing.assert_allclose(sel.weights[~in_a], 1.0)


# ---------------------------------------------------------------- factories, removers

@pytest.mark.parametrize("spec, cls", [
    (SamplerSpec(type="uniform"), Uniform), (SamplerSpec(type="prioritized", alpha=0.6), Prioritized),
    (SamplerSpec(type="fifo"), Fifo), (SamplerSpec(type="lifo"), Lifo),
    (SamplerSpec(type="max_heap"), MaxHeap), (SamplerSpec(type="min_heap"), MinHeap),
    (SamplerSpec(type="group", group_size=4, group_order="fifo"), GroupSampler),
    (SamplerSpec(type="group", group_size=4, task_weights={"*": 1.0}), TaskMixture),
])
def test_make_sampler(spec, cls):
    s = make_sampler(spec, Codebook())
    assert isinstance(s, cls) and Selector in type(s).__mro__
    assert len(s) == 0 and not s.can_sample(spec.group_size or 1)
    assert s.rejected().tolist() == []
    if cls is TaskMixture:
        assert s.unit == 4


def test_removers_pick_the_right_victims():
    pool = Pool()
    batch = pool.new(5, priorities=[2.0, 0.5, 9.0, 0.5, 1.0])
    rem = {name: make_remover(name) for name in ("fifo", "lifo", "min_priority")}
    for r in rem.values():
        r.insert(batch)
    rng = np.random.default_rng(0)
    assert rem["fifo"].sample(2, rng).slots.tolist() == [0, 1]
    assert rem["lifo"].sample(2, rng).slots.tolist() == [4, 3]
    assert rem["min_priority"].sample(3, rng).slots.tolist() == [1, 3, 4]
    rem["min_priority"].update(np.array([2]), np.array([0.0]))
    assert rem["min_priority"].sample(1, rng).slots.tolist() == [2]
    with pytest.raises(InvalidArgument):
        make_remover("random")


def test_growth_beyond_initial_capacity_everywhere():
    big = np.arange(5000)
    for s in (Uniform(), Prioritized(capacity=4), Fifo(), Lifo(), MaxHeap(), MinHeap(), GroupSampler(1)):
        s.insert(items(big[:10]))
        s.insert(items(big[10:], groups=np.arange(4990) if isinstance(s, GroupSampler) else None))
        assert len(s) == 5000
        got = s.sample(4990, np.random.default_rng(0)).slots
        assert got.min() >= 0 and got.max() < 5000
