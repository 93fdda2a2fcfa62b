"""The staleness record of returned items and consumer-group lag, in Table.stats()."""

from __future__ import annotations

from expstore.spec import SamplerSpec, TableSpec
from expstore.synthetic import trajectories
from expstore.table import STALENESS_BUCKETS, Table


def staleness(stats: dict[str, float], op: str) -> dict[str, float]:
    return {k.removeprefix(f"staleness.{op}."): v for k, v in stats.items() if k.startswith(f"staleness.{op}.")}


def test_sampled_items_are_counted_by_versions_behind():
    t = Table(TableSpec("t", sampler=SamplerSpec("fifo"), max_times_sampled=1))  # a queue
    t.insert(trajectories(4, tokens=8, policy_version=0, id_prefix="v0"))
    t.insert(trajectories(4, tokens=8, policy_version=2, id_prefix="v2"))
    t.insert(trajectories(2, tokens=8, policy_version=9, id_prefix="v9"))  # ahead of the table: 0 behind
    t.set_policy_version(3)
    t.sample(6)  # fifo: the four at v0 (3 behind), two at v2 (1 behind)
    t.sample(4)  # two at v2, two at v9
    s = t.stats()
    want = {f"le_{b}": n for b, n in zip(STALENESS_BUCKETS, [2, 6, 6, 10, 10, 10, 10, 10])}
    assert staleness(s, "sample") == {**want, "sum": 4 * 3 + 4 * 1}
    assert s["samples"] == 10
    assert staleness(s, "stream") == {**{f"le_{b}": 0 for b in STALENESS_BUCKETS}, "sum": 0}


def test_items_beyond_the_last_bucket_count_only_in_the_total():
    t = Table(TableSpec("t"))
    t.insert(trajectories(3, tokens=8, policy_version=0))
    t.set_policy_version(100)
    t.sample(5)
    s = t.stats()
    assert s["staleness.sample.le_64"] == 0 and s["samples"] == 5 and s["staleness.sample.sum"] == 500


def test_streamed_items_and_group_lag():
    t = Table(TableSpec("t", max_size=6))
    t.insert(trajectories(6, tokens=8, policy_version=1, id_prefix="a"))  # ids 1..6
    t.set_policy_version(2)
    t.stream("g", 2)  # ids 1, 2: one version behind
    s = t.stats()
    assert s["staleness.stream.le_0"] == 0 and s["staleness.stream.le_1"] == 2 and s["staleness.stream.sum"] == 2
    assert s["group.g.lag"] == 4 and s["group.g.inflight"] == 2
    t.insert(trajectories(3, tokens=8, policy_version=2, id_prefix="b"))  # ids 7..9 evict 1..3
    assert t.stats()["group.g.lag"] == 6  # live and unread: 4..9 (3 left unread)
    t.stream("g", 10)
    assert t.stats()["group.g.lag"] == 0
