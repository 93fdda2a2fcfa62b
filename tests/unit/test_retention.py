"""Retention classes (expstore/retention.py): a hot window for sampling, by time and by
bytes, and a total window for the archive, by time and by bytes. What is sampleable, what
is in the archive (scan_archive, SQL), what is deleted and when, exactly, with an injected
wall clock; and the same after a restart."""

from __future__ import annotations

import pyarrow as pa
import pytest

from expstore import query as q
from expstore.errors import DeadlineExceeded, InvalidArgument
from expstore.journal import Journal
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.table import Table
from expstore.tiers.remote import RemoteTier

from _clock import T0, Wall

pytestmark = pytest.mark.timeout(120)


def batch(prefix: str, n: int = 4) -> pa.Table:
    return trajectories(n, tokens=16, id_prefix=prefix)


def live(t: Table) -> list[str]:
    return sorted(v for b in t.scan(["traj_id"]) for v in b.column("traj_id").to_pylist())


def archived(t: Table) -> list[str]:
    reader = t.scan_archive(["traj_id", "_removed"])
    rows = reader.read_all()
    assert set(rows.column("_removed").to_pylist()) <= {"retention"}
    return sorted(rows.column("traj_id").to_pylist())


@pytest.fixture
def remote_store(tmp_path, monkeypatch):
    """``open_store()``: a durable store with a remote tier, its tables on ``wall``."""
    wall = Wall()
    uri = (tmp_path / "remote").as_uri()
    monkeypatch.setattr(Catalog, "_open", lambda self, s, storage: Table(s, seed=0, storage=storage, wall_clock=wall))
    stores = []

    def open_store() -> Catalog:
        stores.append(Catalog(tmp_path / "d", remote=lambda name: RemoteTier(uri, name)))
        return stores[-1]
    open_store.wall, open_store.uri = wall, uri
    yield open_store
    stores[-1].close()  # the others were closed by the test before it reopened the store


def test_the_hot_window_by_time_stops_sampling_exactly_at_its_end():
    wall = Wall()
    t = Table(TableSpec("t", sampler=SamplerSpec("fifo"), hot_retention_s=10.0), wall_clock=wall)
    t.insert(batch("a"))
    wall.now = T0 + 5
    t.insert(batch("b"))
    wall.now = T0 + 9.999
    assert len(t.sample(8, timeout=0).data) == 8  # all sampleable until the end of a's window
    wall.now = T0 + 10  # a leaves exactly now (no archive: deleted)
    got = t.sample(4, timeout=0).data.column("traj_id").to_pylist()
    assert got == [f"b-{i}" for i in range(4)] and len(t) == 4
    assert t.stats()["removed_retention"] == 4
    wall.now = T0 + 15
    assert t.stats()["items"] == 0 and t.stats()["removed_retention"] == 8


def test_the_hot_window_by_bytes_drops_the_oldest_chunks_first():
    t = Table(TableSpec("t", sampler=SamplerSpec("fifo")), wall_clock=Wall())
    t.insert(batch("x"))
    one = t.stats()["memory_bytes"]  # one insert is one chunk of this many bytes
    t = Table(TableSpec("t", sampler=SamplerSpec("fifo"), hot_retention_bytes=int(2 * one)), wall_clock=Wall())
    for p in "abc":
        t.insert(batch(p))
    assert t.stats()["removed_retention"] == 4  # the third insert made it 3 chunks: a left at this call
    assert live(t) == sorted([f"{p}-{i}" for p in "bc" for i in range(4)])
    t.insert(batch("d"))
    assert live(t) == sorted([f"{p}-{i}" for p in "cd" for i in range(4)])


def test_items_leaving_the_hot_window_move_to_the_archive_and_stay_queryable(remote_store):
    store, wall = remote_store(), remote_store.wall
    t = store.create_table(TableSpec("t", tiers="remote", archive=True, sampler=SamplerSpec("fifo"),
                                     hot_retention_s=10.0, retention_s=30.0))
    t.insert(batch("a"))
    wall.now = T0 + 10
    t.insert(batch("b"))  # a leaves the hot window at this call
    assert t.archive_pending() == 1
    assert archived(t) == [f"a-{i}" for i in range(4)]
    assert t.sample(4, timeout=0).data.column("traj_id").to_pylist() == [f"b-{i}" for i in range(4)]
    with pytest.raises(DeadlineExceeded, match=r"cannot serve 5 items yet \(4 eligible\)"):  # a never again
        t.sample(5, timeout=0)
    sql = q.query(q.store_sources(store), "SELECT tier, count(*) AS n FROM t GROUP BY tier ORDER BY tier").read_all()
    assert sql.to_pylist() == [{"tier": "archive", "n": 4}, {"tier": "memory", "n": 4}]
    assert t.stats()["archive_fragments"] == 1 and t.stats()["archive_bytes"] > 0


def test_the_total_window_by_time_deletes_archive_fragments_once_their_newest_row_is_that_old(remote_store):
    store, wall = remote_store(), remote_store.wall
    t = store.create_table(TableSpec("t", tiers="remote", archive=True, sampler=SamplerSpec("fifo"),
                                     hot_retention_s=10.0, retention_s=30.0))
    t.insert(batch("a"))          # inserted T0: hot until T0 + 10, archived until T0 + 30
    wall.now = T0 + 5
    t.insert(batch("b"))          # T0 + 5: until T0 + 15, T0 + 35
    wall.now = T0 + 15
    assert t.stats()["items"] == 0  # a and b left the hot window
    assert t.archive_pending() == 2 and archived(t) == sorted(f"{p}-{i}" for p in "ab" for i in range(4))
    archive = RemoteTier(remote_store.uri, "t.archive")
    fragments = archive.chunk_ids()
    wall.now = T0 + 29.999
    t.insert(batch("c"))          # hot until T0 + 39.999
    assert t.archive_pending() == 0 and len(archived(t)) == 8
    wall.now = T0 + 30            # a's fragment goes; b's stays
    assert t.archive_pending() == 1
    assert archived(t) == [f"b-{i}" for i in range(4)]
    assert RemoteTier(remote_store.uri, "t.archive").chunk_ids() == fragments[1:]  # only a's fragment deleted
    assert live(t) == [f"c-{i}" for i in range(4)]  # live items untouched by the total window
    s = t.stats()
    assert (s["archive_expired_fragments"], s["archive_fragments"]) == (1, 1) and s["archive_expired_bytes"] > 0
    wall.now = T0 + 35
    assert t.archive_pending() == 1 and archived(t) == [] and live(t) == [f"c-{i}" for i in range(4)]


def test_the_total_window_by_bytes_deletes_the_oldest_fragments(remote_store):
    store, wall = remote_store(), remote_store.wall
    spec = dict(tiers="remote", archive=True, sampler=SamplerSpec("fifo"), hot_retention_s=1.0)
    t = store.create_table(TableSpec("probe", **spec))
    t.insert(batch("x"))
    chunk = t.stats()["memory_bytes"]
    wall.now = T0 + 1
    t.stats()
    t.archive_pending()
    fragment = t.stats()["archive_bytes"]
    # room for the live chunk and two fragments: the third fragment pushes the oldest out
    t = store.create_table(TableSpec("t", **spec, retention_bytes=int(chunk + 2 * fragment)))
    for k, p in enumerate("abcd"):
        wall.now = T0 + 10 * k
        t.insert(batch(p))  # the one before leaves the hot window
        while t.archive_pending():
            pass
    assert live(t) == [f"d-{i}" for i in range(4)]
    assert archived(t) == sorted(f"{p}-{i}" for p in "bc" for i in range(4))
    assert t.stats()["archive_expired_fragments"] == 1


@pytest.mark.parametrize("snapshots", [False, True])
def test_both_windows_resume_after_a_restart(remote_store, monkeypatch, snapshots):
    monkeypatch.setattr(Journal, "wants_snapshot", lambda self: snapshots)
    store, wall = remote_store(), remote_store.wall
    t = store.create_table(TableSpec("t", tiers="remote", archive=True, sampler=SamplerSpec("fifo"),
                                     hot_retention_s=10.0, retention_s=30.0))
    t.insert(batch("a"))
    wall.now = T0 + 5
    t.insert(batch("b"))
    wall.now = T0 + 10
    t.insert(batch("c"))          # a leaves
    t.archive_pending()           # and is archived (newest row: T0)
    store.close()

    wall.now = T0 + 15            # b's hot window ended while the server was down
    store = remote_store()
    t = store.table("t")
    assert live(t) == [f"c-{i}" for i in range(4)]  # b leaves at the first call
    assert t.archive_pending() == 1 and archived(t) == sorted(f"{p}-{i}" for p in "ab" for i in range(4))
    store.close()

    wall.now = T0 + 30            # a's fragment expires by its newest row, as before the restart; c leaves
    store = remote_store()
    t = store.table("t")
    assert live(t) == []
    while t.archive_pending():
        pass
    assert archived(t) == sorted(f"{p}-{i}" for p in "bc" for i in range(4))
    store.close()
    store = remote_store()  # closed by the fixture
    assert archived(store.table("t")) == sorted(f"{p}-{i}" for p in "bc" for i in range(4))
    assert store.table("t").stats()["archive_fragments"] == 2


def test_retention_config_is_checked():
    with pytest.raises(InvalidArgument, match="retention_s and retention_bytes bound the archive"):
        TableSpec("t", retention_s=10.0)
    with pytest.raises(InvalidArgument, match=r"hot_retention_s \(20.0\) must not exceed retention_s \(10.0\)"):
        TableSpec("t", tiers="remote", archive=True, hot_retention_s=20.0, retention_s=10.0)
    with pytest.raises(InvalidArgument, match="hot_retention_bytes must be an integer number of bytes >= 1"):
        TableSpec("t", hot_retention_bytes=0)
    with pytest.raises(InvalidArgument, match="hot_retention_s must be a finite number of seconds > 0"):
        TableSpec("t", hot_retention_s=float("inf"))
    spec = TableSpec.from_dict({"name": "t", "tiers": "remote", "archive": True, "hot_retention_s": 60,
                                "hot_retention_bytes": 1 << 20, "retention_s": 3600, "retention_bytes": 1 << 30})
    assert TableSpec.from_dict(spec.to_dict()) == spec
