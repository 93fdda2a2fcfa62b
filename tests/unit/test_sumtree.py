"""SumTree: sums, descent, growth, and the no-drift invariant."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from expstore.samplers.sumtree import SumTree


def leaves(tree: SumTree, n: int) -> np.ndarray:
    return tree.get(np.arange(n))


def assert_exact_parents(tree: SumTree) -> None:
    """Every internal node is exactly the float sum of its two children."""
    t, cap = tree._tree, tree.capacity
    i = np.arange(1, cap)
    np.testing.assert_array_equal(t[i], t[2 * i] + t[2 * i + 1])


def test_total_get_and_find():
    t = SumTree(capacity=8)
    t.set(np.array([0, 2, 5]), np.array([1.0, 3.0, 6.0]))
    assert t.total == 10.0
    assert t.get(np.array([0, 1, 2, 5, 100])).tolist() == [1.0, 0.0, 3.0, 6.0, 0.0]
    got = t.find(np.array([0.0, 0.999, 1.0, 3.99, 4.0, 9.99]))
    assert got.tolist() == [0, 0, 2, 2, 5, 5]


def test_find_matches_cumsum_reference():
    rng = np.random.default_rng(1)
    t = SumTree(capacity=64)
    vals = rng.random(1000) * (rng.random(1000) < 0.7)  # ~30% zeros
    t.set(np.arange(1000), vals)
    targets = rng.random(5000) * t.total
    expected = np.searchsorted(np.cumsum(vals), targets, side="right")
    got = t.find(targets)
    # float rounding may differ only right at a boundary; such targets are vanishingly rare
    assert np.mean(got == expected) > 0.999
    assert np.all(vals[got] > 0)


def test_never_returns_a_zero_leaf_even_at_the_total():
    t = SumTree(capacity=16)
    t.set(np.array([0, 3, 7]), np.array([0.1, 0.2, 0.3]))  # slots 8..15 are zero
    for target in (t.total, np.nextafter(t.total, 0), t.total * (1 + 1e-15), 0.1, 0.3):
        slot = int(t.find(np.array([target]))[0])
        assert slot in (0, 3, 7)
    assert t.find(np.array([t.total]))[0] == 7


def test_single_slot_tree():
    t = SumTree(capacity=1)
    t.set(np.array([0]), np.array([2.0]))
    assert t.capacity == 1 and t.total == 2.0
    assert t.find(np.array([0.0, 1.9])).tolist() == [0, 0]


def test_growth_beyond_initial_capacity_keeps_leaves():
    t = SumTree(capacity=4)
    t.set(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    t.set(np.array([37]), np.array([5.0]))
    assert t.capacity == 64
    assert t.total == 15.0
    assert t.get(np.array([0, 1, 2, 3, 37])).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert t.find(np.array([14.5]))[0] == 37
    assert_exact_parents(t)


def test_zeroing_everything_gives_exactly_zero():
    rng = np.random.default_rng(2)
    t = SumTree(capacity=256)
    t.set(np.arange(256), rng.random(256) * 1e-3 + rng.random(256) * 1e6)
    for chunk in np.array_split(rng.permutation(256), 7):
        t.set(chunk, 0.0)
    assert t.total == 0.0


def test_find_is_proportional_chisquare():
    rng = np.random.default_rng(3)
    vals = np.array([1.0, 0.0, 2.0, 3.0, 0.5, 0.0, 4.0, 1.5])
    t = SumTree(capacity=2)
    t.set(np.arange(len(vals)), vals)
    n = 40_000
    counts = np.bincount(t.find(rng.random(n) * t.total), minlength=len(vals))
    nz = vals > 0
    assert counts[~nz].sum() == 0
    assert chisquare(counts[nz], n * vals[nz] / vals.sum()).pvalue > 1e-3


def test_repeated_slot_in_one_set_last_wins():
    t = SumTree(capacity=4)
    t.set(np.array([1, 1, 2]), np.array([5.0, 7.0, 1.0]))
    assert t.total == 8.0 and t.get(np.array([1]))[0] == 7.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 300), min_size=1, max_size=40),
                          st.floats(0, 1e6, allow_nan=False)),
                min_size=1, max_size=25),
       st.integers(0, 9))
def test_total_equals_sum_of_leaves_after_random_updates(updates, init_log2):
    t = SumTree(capacity=1 << init_log2)
    ref = np.zeros(301)
    rng = np.random.default_rng(len(updates))
    for slots, scale in updates:
        slots = np.array(slots)
        vals = rng.random(len(slots)) * scale
        t.set(slots, vals)
        ref[slots] = vals  # numpy fancy assignment: last wins, like the tree
    np.testing.assert_array_equal(leaves(t, 301), ref)
    assert math.isclose(t.total, math.fsum(ref), rel_tol=1e-12, abs_tol=0.0)
    assert_exact_parents(t)
    if t.total > 0:
        assert np.all(ref[t.find(rng.random(50) * t.total)] > 0)


def test_invalid_capacity():
    with pytest.raises(ValueError):
        SumTree(capacity=0)
