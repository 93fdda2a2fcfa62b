"""The sharded client's pure parts: placement (stable, order-free, spread, minimal
movement), sharded ids, server lists, stats merging, and the union's sampling maths
checked against the engine's own samplers over the union."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats as sps

from expstore.samplers import Prioritized, Uniform
from expstore_client import SampleBatch
from expstore_client import _merge, _shard_ids
from expstore_client._placement import hash_strings, place, placement_keys
from expstore_client._targets import resolve
from expstore_client._union import UnionSampler

SHARDS = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
names = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6, unique=True)
keys = st.lists(st.one_of(st.none(), st.text(max_size=20)), max_size=60)


def reference_hash(text: str) -> int:
    """FNV-1a 64 over UTF-8, then murmur3 fmix64, in plain Python integers."""
    m = (1 << 64) - 1
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & m
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & m
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & m
    return h ^ (h >> 33)


# -- placement ---------------------------------------------------------------------------

def test_placement_is_pinned():
    """The same shard for the same key in every process, release and machine: changing
    the hash would move every stored group."""
    assert hash_strings(["", "a", "traj-0", "héllo"]).tolist() == [
        17280346270528514342, 9413272369427828315, 5020058837055226902, 13944623458183816781]
    assert place(pa.array(["traj-0", "traj-1", "traj-2", "g-7", ""]), SHARDS).tolist() == [1, 2, 2, 2, 2]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=20))
def test_vectorised_hash_matches_the_reference(texts):
    arr = pa.array(["pad", *texts]).slice(1)  # a sliced array: offsets do not start at 0
    assert hash_strings(arr).tolist() == [reference_hash(t) for t in texts]


@settings(max_examples=50, deadline=None)
@given(keys, names, st.randoms())
def test_placement_does_not_depend_on_the_order_of_the_servers(values, shards, rnd):
    shuffled = shards[:]
    rnd.shuffle(shuffled)
    arr = pa.array(values, pa.string())
    assert [shards[k] for k in place(arr, shards)] == [shuffled[k] for k in place(arr, shuffled)]


@settings(max_examples=50, deadline=None)
@given(keys, names, st.text(min_size=1, max_size=12))
def test_a_new_shard_only_takes_keys_from_the_others(values, shards, new):
    if new in shards:
        return
    arr = pa.array(values, pa.string())
    before = [shards[k] for k in place(arr, shards)]
    after = [(shards + [new])[k] for k in place(arr, shards + [new])]
    assert all(a == b or a == new for a, b in zip(after, before))


def test_placement_spreads_keys_evenly():
    for n in (2, 3, 5, 8):
        shards = [f"expstore-{i}.expstore:50051" for i in range(n)]
        counts = np.bincount(place(pa.array([f"traj-{i}" for i in range(30_000)]), shards), minlength=n)
        assert sps.chisquare(counts).pvalue > 1e-3, counts


def test_chunks_and_nulls_place_like_their_values():
    chunked = pa.chunked_array([pa.array(["a", None]), pa.array(["b", "a"])])
    assert place(chunked, SHARDS).tolist() == place(pa.array(["a", "", "b", "a"]), SHARDS).tolist()
    assert place(pa.array([], pa.string()), SHARDS).tolist() == []


def test_rows_are_placed_by_group_then_by_traj_id():
    t = pa.table({"traj_id": ["t1", "t2", "t3"], "group_id": ["g", None, "g"]})
    assert placement_keys(t, None).to_pylist() == ["g", "t2", "g"]
    assert placement_keys(pa.table({"k": ["x"]}), "k").to_pylist() == ["x"]
    assert placement_keys(pa.table({"v": [1]}), None) is None


# -- ids and server lists ------------------------------------------------------------

def test_sharded_ids_round_trip_and_group_by_shard():
    ids = np.concatenate([_shard_ids.encode(2, [5, 1]), _shard_ids.encode(0, [5]), _shard_ids.encode(2, [9])])
    shard, local = _shard_ids.decode(ids)
    assert shard.tolist() == [2, 2, 0, 2] and local.tolist() == [5, 1, 5, 9]
    parts = _shard_ids.by_shard(ids, 3)
    assert {k: (p.tolist(), l.tolist()) for k, (p, l) in parts.items()} == {0: ([2], [5]), 2: ([0, 1, 3], [5, 1, 9])}
    with pytest.raises(ValueError, match="names shard 2, but there are 2 shards"):
        _shard_ids.by_shard(ids, 2)
    with pytest.raises(OverflowError, match="shard s1: item id"):
        _shard_ids.encode(1, [1 << 48], "s1")


def test_server_lists():
    assert resolve("b:1, a:2") == ["a:2", "b:1"] == resolve(["a:2", "b:1"])
    assert resolve("dns:///localhost:7000") == ["127.0.0.1:7000"]
    with pytest.raises(ValueError, match="listed twice: a:1"):
        resolve("a:1,a:1")
    with pytest.raises(ValueError, match="expected dns:///HOST:PORT"):
        resolve("dns:///nohost")
    with pytest.raises(ValueError, match="no server addresses"):
        resolve(" , ")


def test_stats_merge_sums_counters_and_keeps_settings():
    per_shard = {"a": {"t": {"items": 3, "policy_version": 4, "group.g.position": 9, "group.g.acked": 2}},
                 "b": {"t": {"items": 5, "policy_version": 4, "group.g.position": 2, "group.g.acked": 1}}}
    assert _merge.stats(per_shard, ["c"]) == {"t": {"items": 8, "policy_version": 4, "group.g.acked": 3,
                                                    "shards_up": 2, "shards_down": 1}}


# -- the union's sampling maths against one table ----------------------------------------

def shards_of(priorities: np.ndarray, owner: np.ndarray, alpha: float, beta: float):
    """One Prioritized sampler per shard and one over the union, slot i = item i."""
    union = Prioritized(alpha, beta)
    union.insert_priorities(np.arange(len(priorities)), priorities)
    parts = []
    for k in range(owner.max() + 1):
        s = Prioritized(alpha, beta)
        s.insert_priorities(np.flatnonzero(owner == k), priorities[owner == k])
        parts.append(s)
    return union, parts


def batch_of(probabilities: np.ndarray) -> SampleBatch:
    n = len(probabilities)
    return SampleBatch(ids=np.zeros(n, np.uint64), data=pa.table({"x": np.zeros(n)}), priorities=np.ones(n),
                       times_sampled=np.zeros(n, np.int64), policy_versions=np.zeros(n, np.int64),
                       probabilities=probabilities, weights=np.full(n, np.nan))


@pytest.mark.parametrize("alpha,beta", [(1.0, 0.4), (0.6, 1.0), (0.0, 0.5)])
def test_prioritized_probabilities_and_weights_equal_one_tables(alpha, beta):
    rng = np.random.default_rng(0)
    priorities = rng.uniform(0.1, 10.0, 50)
    owner = rng.integers(0, 3, 50)
    union, parts = shards_of(priorities, owner, alpha, beta)
    sampler = UnionSampler.of("t", {"type": "prioritized", "alpha": alpha, "beta": beta})
    masses = sampler.masses([{"sampler_eligible": len(s), "sampler.total_priority": s.stats()["total_priority"]}
                             for s in parts])
    items = rng.integers(0, 50, 40)  # a batch drawn from every shard
    shard_p = np.array([parts[owner[i]].probabilities(np.array([i]))[0] for i in items])
    got = sampler.reweight(batch_of(shard_p), owner[items], masses)
    expected_p = union.probabilities(items)
    n = len(priorities)
    assert np.allclose(got.probabilities, expected_p, rtol=1e-12)
    assert np.allclose(got.weights, (n * expected_p) ** -beta / ((n * expected_p) ** -beta).max(), rtol=1e-12)


def test_all_zero_priorities_fall_back_to_uniform_over_the_union():
    sampler = UnionSampler.of("t", {"type": "prioritized", "alpha": 1.0, "beta": 0.0})
    masses = sampler.masses([{"sampler_eligible": 2, "sampler.total_priority": 0.0},
                             {"sampler_eligible": 6, "sampler.total_priority": 0.0}, None])
    assert masses.tolist() == [2, 6, 0]
    got = sampler.reweight(batch_of(np.array([1 / 2, 1 / 6])), np.array([0, 1]), masses)
    assert np.allclose(got.probabilities, 1 / 8)


def test_uniform_split_is_multinomial_over_the_shards_that_are_up():
    sampler = UnionSampler.of("t", {"type": "uniform"})
    u = [Uniform() for _ in range(3)]
    for k, n in enumerate((10, 30, 60)):
        u[k].insert_slots(np.arange(n))
    masses = sampler.masses([{"sampler_eligible": len(s)} for s in u])
    up = np.array([True, True, False])
    counts = sampler.split(40_000, masses, up, np.zeros(3, np.int64), np.random.default_rng(1))
    assert counts[2] == 0 and counts.sum() == 40_000
    assert sps.chisquare(counts[:2], np.array([10, 30]) / 40 * 40_000).pvalue > 1e-3


def test_group_split_takes_distinct_groups_and_waits_for_missing_ones():
    sampler = UnionSampler.of("t", {"type": "group", "group_size": 4})
    assert sampler.units(32) == 8
    with pytest.raises(ValueError, match="batch_size=6 is not a multiple of group_size=4"):
        sampler.units(6)
    masses = sampler.masses([{"sampler.complete_groups": 2}, {"sampler.complete_groups": 0},
                             {"sampler.complete_groups": 10}])
    up, rng = np.ones(3, bool), np.random.default_rng(2)
    for _ in range(200):
        counts = sampler.split(5, masses, up, np.zeros(3, np.int64), rng)
        assert counts.sum() == 5 and counts[0] <= 2 and counts[1] == 0
    again = sampler.split(3, masses, up, np.array([2, 0, 7]), rng)  # a shard's share drawn again
    assert again.tolist() == [0, 0, 3]
    short = sampler.split(20, masses, up, np.zeros(3, np.int64), rng)  # only 12 complete
    assert short.sum() == 20 and short[0] >= 2 and short[2] >= 10


def test_task_weights_count_only_weighted_tasks():
    sampler = UnionSampler.of("t", {"type": "uniform", "task_weights": {"math": 1.0, "code": 0.0}})
    stats = {"sampler.task.math.items": 4, "sampler.task.code.items": 9, "sampler.task.*.items": 5}
    assert sampler.masses([stats]).tolist() == [4]
    with_default = UnionSampler.of("t", {"type": "uniform", "task_weights": {"*": 1.0, "code": 0.0}})
    assert with_default.masses([stats]).tolist() == [9]


@pytest.mark.parametrize("config", [{"type": "fifo"}, {"type": "max_heap"},
                                    {"type": "group", "group_size": 2, "group_order": "fifo"},
                                    {"type": "group", "group_size": 2, "group_order": "lifo"}])
def test_samplers_with_a_global_order_have_no_union(config):
    with pytest.raises(ValueError, match="orders items across the whole table"):
        UnionSampler.of("t", config)
