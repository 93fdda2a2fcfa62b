"""Group timeouts (expstore/group_timeouts.py): a GRPO group that has not completed
``group_timeout_s`` after its first member arrived is released with what it has
(flagged, group_size corrected) or dropped; late members are refused; a waiting sample
is never wedged; deadlines and outcomes survive a restart (journal and snapshot).

Engine-level, with an injected wall clock: the deadlines are exact to the tick."""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from expstore.errors import DeadlineExceeded, InvalidArgument, NotFound
from expstore.journal import Journal
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.table import Table

from _clock import T0, Wall

pytestmark = pytest.mark.timeout(60)


def spec(action: str = "release", timeout: float = 10.0, size: int = 4, **kw) -> TableSpec:
    kw.setdefault("sampler", SamplerSpec("group", group_size=size, group_order="fifo"))
    return TableSpec("t", group_timeout_s=timeout, group_timeout_action=action, **kw)


def members(group: str, k: int, start: int = 0, size: int = 4, reward=None) -> pa.Table:
    """Members start..start+k-1 of group ``group`` (traj ids ``group-i``)."""
    t = trajectories(k, tokens=12, seed=start, id_prefix=group,
                     reward=None if reward is None else np.asarray(reward, np.float32))
    ids = pa.array([f"{group}-{i}" for i in range(start, start + k)])
    t = t.set_column(0, "traj_id", ids)
    t = t.set_column(t.schema.get_field_index("group_id"), "group_id", pa.array([group] * k))
    return t.set_column(t.schema.get_field_index("group_size"), "group_size", pa.array([size] * k, pa.int32()))


def sample_ids(table: Table, n: int) -> tuple[list[str], list, list]:
    rows = table.sample(n, timeout=0)
    d = rows.data
    return (d.column("traj_id").to_pylist(), d.column("group_size").to_pylist(),
            d.column("group_released_partial").to_pylist())


def test_release_at_the_deadline_of_the_first_member_exactly():
    wall = Wall()
    t = Table(spec(), wall_clock=wall)
    assert "group_released_partial" in t.schema.names
    t.insert(members("a", 2))
    wall.now = T0 + 8  # a later member does not move the deadline
    t.insert(members("a", 1, start=2))
    wall.now = T0 + 9.999
    with pytest.raises(DeadlineExceeded, match="cannot serve 4"):
        t.sample(4, timeout=0)
    assert t.stats()["group_timeouts_released"] == 0
    wall.now = T0 + 10  # first arrival + group_timeout_s
    ids, sizes, partial = sample_ids(t, 4)
    assert ids == ["a-0", "a-1", "a-2"]  # one group of the batch: 3 rows, not 4
    assert sizes == [3, 3, 3] and partial == [True, True, True]
    s = t.stats()
    assert s["group_timeouts_released"] == 1 and s["group_timeouts_dropped"] == 0 and s["items"] == 3
    got = t.get(t.sample(4, timeout=0).item_ids).data  # get and scan say the same
    assert got.column("group_size").to_pylist() == [3, 3, 3]
    scanned = pa.Table.from_batches(list(t.scan(["traj_id", "group_size", "group_released_partial"])))
    assert scanned.column("group_released_partial").to_pylist() == [True] * 3
    assert scanned.column("group_size").to_pylist() == [3] * 3


def test_groups_complete_in_time_are_untouched_and_unflagged():
    wall = Wall()
    t = Table(spec(), wall_clock=wall)
    t.insert(members("a", 3))
    wall.now = T0 + 5
    t.insert(members("b", 4))  # complete at once
    wall.now = T0 + 9
    t.insert(members("a", 1, start=3))  # a completes before its deadline
    wall.now = T0 + 100
    ids, sizes, partial = sample_ids(t, 8)
    assert sorted(ids) == sorted([f"a-{i}" for i in range(4)] + [f"b-{i}" for i in range(4)])
    assert sizes == [4] * 8 and partial == [False] * 8
    assert t.stats()["group_timeouts_released"] == 0


def test_late_members_of_a_released_group_are_acknowledged_but_never_stored():
    wall = Wall()
    t = Table(spec(), wall_clock=wall)
    t.insert(members("a", 2))
    wall.now = T0 + 11
    t.stats()  # any call settles what is due
    r = t.insert(members("a", 2, start=2))
    assert r.num_inserted == 2 and r.num_stale == 0 and len(r.item_ids) == 2
    s = t.stats()
    assert s["removed_group_late"] == 2 and s["items"] == 2
    with pytest.raises(NotFound):
        t.get(r.item_ids)
    assert t.insert(members("a", 1, start=2)).num_duplicates == 1  # a retry is still a duplicate
    ids, sizes, _ = sample_ids(t, 4)
    assert ids == ["a-0", "a-1"] and sizes == [2, 2]


def test_drop_removes_the_members_and_counts_them():
    wall = Wall()
    t = Table(spec("drop", max_times_sampled=1), wall_clock=wall)
    t.insert(members("a", 3))
    t.insert(members("b", 4))
    wall.now = T0 + 10
    s = t.stats()
    assert s["removed_group_timeout"] == 3 and s["group_timeouts_dropped"] == 1 and s["items"] == 4
    t.insert(members("a", 1, start=3))
    assert t.stats()["removed_group_late"] == 1
    ids, _, partial = sample_ids(t, 4)
    assert ids == [f"b-{i}" for i in range(4)] and partial == [False] * 4
    with pytest.raises(DeadlineExceeded):  # nothing of a is left to sample
        t.sample(4, timeout=0)


def test_released_groups_keep_their_order_and_drop_zero_variance():
    wall = Wall()
    sampler = SamplerSpec("group", group_size=4, group_order="fifo", drop_zero_variance=True)
    t = Table(spec(sampler=sampler), wall_clock=wall)
    t.insert(members("flat", 2, reward=[1.0, 1.0]))  # equal rewards: no signal once released
    t.insert(members("a", 3, reward=[0.0, 1.0, 0.5]))
    wall.now = T0 + 1
    t.insert(members("b", 4, reward=[0.0, 1.0, 0.0, 1.0]))
    wall.now = T0 + 10
    ids, sizes, partial = sample_ids(t, 8)
    # fifo by the id of the group's last member: a (released) came before b
    assert ids == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2", "b-3"]
    assert sizes == [3, 3, 3, 4, 4, 4, 4] and partial == [True] * 3 + [False] * 4
    assert t.stats()["removed_zero_variance"] == 2


def test_a_group_that_lost_a_member_is_not_released():
    wall = Wall()
    t = Table(spec(max_staleness=0), wall_clock=wall)
    t.insert(members("a", 2))
    t.set_policy_version(1)  # both members are stale now: the group broke
    t.insert(members("b", 1).set_column(8, "policy_version", pa.array([1], pa.int64())))
    wall.now = T0 + 10
    ids, sizes, partial = sample_ids(t, 4)
    assert ids == ["b-0"] and partial == [True]
    assert t.stats()["group_timeouts_released"] == 1


def test_timeouts_with_task_mixing():
    wall = Wall()
    sampler = SamplerSpec("group", group_size=4, task_weights={"*": 1.0})
    t = Table(spec(sampler=sampler), wall_clock=wall)
    t.insert(members("a", 3))
    wall.now = T0 + 10
    ids, sizes, partial = sample_ids(t, 4)
    assert sorted(ids) == ["a-0", "a-1", "a-2"] and sizes == [3] * 3 and partial == [True] * 3


def test_a_waiting_sample_wakes_at_the_deadline_without_any_other_call():
    t = Table(spec(timeout=0.3))  # the real wall clock
    t.insert(members("a", 3))
    out = {}
    worker = threading.Thread(target=lambda: out.update(rows=t.sample(4, timeout=20)))
    worker.start()
    worker.join(15)
    assert not worker.is_alive(), "the sample stayed wedged past the group's deadline"
    assert out["rows"].data.column("group_released_partial").to_pylist() == [True] * 3


def test_server_filled_column_cannot_be_written_and_config_is_checked():
    t = Table(spec(), wall_clock=Wall())
    rows = members("a", 2).append_column("group_released_partial", pa.array([None, True]))
    with pytest.raises(InvalidArgument, match="row 1, column 'group_released_partial'"):
        t.insert(rows)
    with pytest.raises(InvalidArgument, match="group sampler"):
        TableSpec("t", group_timeout_s=5.0)
    with pytest.raises(InvalidArgument, match="group_timeout_action"):
        spec("wait")
    with pytest.raises(InvalidArgument, match="group_timeout_s"):
        spec(timeout=0.0)
    d = spec("drop", timeout=2.5).to_dict()
    assert TableSpec.from_dict(d) == spec("drop", timeout=2.5)


@pytest.mark.parametrize("snapshots", [False, True], ids=["journal", "snapshot"])
def test_deadlines_and_outcomes_survive_a_restart(tmp_path, monkeypatch, snapshots):
    monkeypatch.setattr(Journal, "wants_snapshot", lambda self: snapshots)
    wall = Wall()
    monkeypatch.setattr(Catalog, "_open", lambda self, s, storage: Table(s, seed=0, storage=storage, wall_clock=wall))
    store = Catalog(tmp_path / "d")
    t = store.create_table(spec())
    t.insert(members("a", 3))           # deadline T0 + 10
    t.insert(members("r", 2))           # deadline T0 + 10, released before the restart
    wall.now = T0 + 4
    t.insert(members("b", 2))           # deadline T0 + 14
    wall.now = T0 + 10
    t.stats()                            # a and r are released now
    t.insert(members("a", 1, start=3))   # late
    store.close()

    wall.now = T0 + 13.5  # restarted before b's deadline: it must not fire early ...
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    ids, sizes, partial = sample_ids(t, 8)
    assert ids == ["a-0", "a-1", "a-2", "r-0", "r-1"] and sizes == [3, 3, 3, 2, 2] and partial == [True] * 5
    assert t.insert(members("r", 1, start=2)).num_inserted == 1  # still late after the restart
    assert t.stats()["removed_group_late"] == 1 and t.stats()["items"] == 7
    store.close()

    wall.now = T0 + 14  # ... nor late: measured from b's first arrival, not from the restart
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    ids, sizes, partial = sample_ids(t, 12)
    assert ids[-2:] == ["b-0", "b-1"] and sizes[-2:] == [2, 2] and partial == [True] * 7
    store.close()


def test_a_deadline_that_passed_while_down_fires_at_the_first_call(tmp_path, monkeypatch):
    wall = Wall()
    monkeypatch.setattr(Catalog, "_open", lambda self, s, storage: Table(s, seed=0, storage=storage, wall_clock=wall))
    store = Catalog(tmp_path / "d")
    store.create_table(spec("drop")).insert(members("a", 3))
    store.close()
    wall.now = T0 + 3600
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert len(t) == 3
    assert t.stats()["removed_group_timeout"] == 3 and len(t) == 0
    store.close()
    store = Catalog(tmp_path / "d")  # and the drop itself was journaled
    assert len(store.table("t")) == 0
    store.close()
