"""Faults of the remote tier: with S3 unreachable, inserts go on into the SSD tier (and
evict items whose chunks only S3 holds), the mover retries with backoff and reports why,
a store restarts knowing from its journal what S3 holds, and once S3 is back every chunk
moves down and nothing was lost or left behind."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest
import s3server

from expstore.errors import DataLoss, Unavailable
from expstore.journal import Journal
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.tiers.remote import RemoteTier

pytestmark = pytest.mark.timeout(120)


def wait_until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_s3_down_inserts_go_on_uploads_retry_and_nothing_is_lost(tmp_path):
    s3 = s3server.start()
    uri = f"s3://{s3.bucket('faults')}/p"
    options = {**s3.lance_options, "client_max_retries": "0", "client_retry_timeout": "1"}
    store = Catalog(tmp_path / "d", remote=lambda name: RemoteTier(uri, name, storage_options=options))
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1 << 20, ssd_bytes=256 << 10))
    store.start_mover(interval_s=0.05, max_backoff_s=0.2)
    inserted = []
    try:
        for i in range(4):
            inserted += t.insert(trajectories(32, tokens=1024, id_prefix=f"up{i}")).item_ids.tolist()
        wait_until(lambda: t.stats()["items_remote"] > 0)
        s3.stop()
        for i in range(4):  # S3 is down: inserts still succeed, into the SSD tier
            inserted += t.insert(trajectories(32, tokens=1024, id_prefix=f"down{i}")).item_ids.tolist()
        wait_until(lambda: store.remote_error is not None and t.stats()["demotion_failures"] > 0)
        assert "remote tier" in store.remote_error
        assert t.stats()["ssd_bytes"] > 256 << 10  # over the watermark, waiting
        with pytest.raises(Unavailable):  # reading what only S3 has fails clearly ...
            t.get(inserted[:1])
        t.get(inserted[-32:])  # ... what the SSD has is served
        s3 = s3server.start(int(s3.endpoint.rsplit(":", 1)[1]))
        wait_until(lambda: store.remote_error is None and t.stats()["ssd_bytes"] <= 512 << 10)
        rows = t.get(inserted)
        assert rows.data.num_rows == len(inserted) == 256
        assert np.array_equal(rows.item_ids, inserted)
        expected = [f"{p}{i}-{j}" for p in ("up", "down") for i in range(4) for j in range(32)]
        assert rows.data.column("traj_id").to_pylist() == expected
    finally:
        store.close()
        s3.stop()


def down_s3_store(tmp_path, s3, bucket: str) -> Catalog:
    """A store on ``tmp_path / "d"`` whose remote tier is ``bucket`` on ``s3``, failing fast."""
    uri = f"s3://{bucket}/p"
    options = {**s3.lance_options, "client_max_retries": "0", "client_retry_timeout": "1"}
    return Catalog(tmp_path / "d", seed=0, remote=lambda name: RemoteTier(uri, name, storage_options=options))


def listed(s3, bucket: str) -> list[int]:
    """The chunk ids S3 holds for table t, read by a tier of its own."""
    tier = RemoteTier(f"s3://{bucket}/p", "t", storage_options=s3.lance_options)
    try:
        return sorted(tier.chunk_ids())
    finally:
        tier.close()


def demote_all(t) -> None:
    while t.demote():
        pass


def test_evicting_remote_items_while_s3_is_down_succeeds_and_their_chunks_are_deleted_later(tmp_path):
    s3 = s3server.start()
    bucket = s3.bucket("evict")
    store = down_s3_store(tmp_path, s3, bucket)
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=64 << 10, max_size=60,
                                     sampler=SamplerSpec("fifo")))
    try:
        for i in range(6):
            t.insert(trajectories(10, tokens=256, id_prefix=f"a{i}"))
            demote_all(t)
        remote_before = t.stats()["remote_chunks"]
        assert remote_before >= 3
        s3.stop()
        for i in range(3):  # each insert evicts the 10 oldest items, whose chunk is on S3 only
            t.insert(trajectories(10, tokens=256, id_prefix=f"b{i}"))
        assert len(t) == 60 and t.stats()["remote_chunks"] == remote_before - 3
        s3 = s3server.start(int(s3.endpoint.rsplit(":", 1)[1]))
        demote_all(t)  # reaches S3 again, deletes the freed chunks, moves the new ones down
        assert len(listed(s3, bucket)) == t.stats()["remote_chunks"]  # the freed chunks are gone from S3
        keys = t.get(t.parts.index["id"][t.parts.index.live_slots()]).data.column("traj_id").to_pylist()
        assert keys == [f"{p}{i}-{j}" for p, n in (("a", 6), ("b", 3)) for i in range(n) for j in range(10)][30:]
    finally:
        store.close()
        s3.stop()


def test_a_store_restores_remote_chunks_from_its_journal_while_s3_is_down(tmp_path, monkeypatch):
    """Demotions, evictions and snapshots at random moments; the restart with S3 down needs
    no listing, and once S3 is back every item reads as it was and nothing is left behind."""
    rng = np.random.default_rng(3)
    monkeypatch.setattr(Journal, "wants_snapshot", lambda self: rng.random() < 0.1)
    s3 = s3server.start()
    bucket = s3.bucket("restore")
    store = down_s3_store(tmp_path, s3, bucket)
    spec = TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=96 << 10, max_size=150)
    t = store.create_table(spec)
    for i in range(25):
        t.insert(trajectories(int(rng.integers(4, 12)), tokens=256, id_prefix=f"x{i}"))
        if rng.random() < 0.6:
            demote_all(t)
        if rng.random() < 0.3:
            t.sample(8)
    ids = t.parts.index["id"][t.parts.index.live_slots()]
    data = t.get(ids).data
    remote, n_remote = listed(s3, bucket), t.stats()["remote_chunks"]  # (S3 may still hold freed chunks)
    assert len(remote) >= n_remote >= 3 and t.stats()["ssd_chunks"] >= 1
    store.close()
    s3.stop()

    store = down_s3_store(tmp_path, s3, bucket)  # on main: Unavailable, listing the remote tier
    t = store.table("t")
    assert np.array_equal(t.parts.index["id"][t.parts.index.live_slots()], ids)
    assert t.stats()["remote_chunks"] == n_remote  # known from the journal
    newest = int(ids[-1])
    assert t.get([newest]).data.to_pylist() == data.slice(len(ids) - 1).to_pylist()  # SSD rows are served
    with pytest.raises(Unavailable, match="remote tier"):
        t.get(ids[:1])
    with pytest.raises(Unavailable, match="remote tier"):
        t.demote()
    t.insert(trajectories(10, tokens=256, id_prefix="late"))  # evicts remote items: fine while S3 is down
    chunk_ids = t.parts.index["chunk"][t.parts.index.live_slots()]
    assert chunk_ids.max() > max(remote)  # a new chunk never reuses an id the remote tier may hold

    s3 = s3server.start(int(s3.endpoint.rsplit(":", 1)[1]))
    try:
        demote_all(t)
        live = t.parts.index["id"][t.parts.index.live_slots()]
        rows = t.get(live).data
        kept = np.isin(ids, live)
        assert rows.slice(0, int(kept.sum())).to_pylist() == data.filter(pa.array(kept)).to_pylist()
        assert len(listed(s3, bucket)) == t.stats()["remote_chunks"]  # nothing left behind
    finally:
        store.close()
        s3.stop()


def test_a_chunk_the_remote_tier_lost_is_quarantined_when_it_is_read_or_the_tier_reached(tmp_path):
    uri = (tmp_path / "remote").as_uri()
    open_store = lambda: Catalog(tmp_path / "d", remote=lambda name: RemoteTier(uri, name))  # noqa: E731
    store = open_store()
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=1))
    ids = [t.insert(trajectories(10, tokens=64, id_prefix=f"c{i}")).item_ids for i in range(3)]
    demote_all(t)
    assert t.stats()["remote_chunks"] == 3
    store.close()
    tier = RemoteTier(uri, "t")
    tier.delete([0, 2])  # lost behind the server's back
    tier.close()
    store = open_store()
    t = store.table("t")
    assert t.stats()["items"] == 30  # nothing asked the remote tier at start
    with pytest.raises(DataLoss, match="chunk 0 moved there has no readable fragment"):
        t.get(ids[0][:1])
    assert (t.stats()["items"], t.stats()["quarantined_items"]) == (20, 10)
    store.close()
    store = open_store()
    t = store.table("t")
    t.demote()  # the mover's first pass reaches the tier: chunk 2 is found lost without a read
    assert (t.stats()["items"], t.stats()["quarantined_items"]) == (10, 20)
    with pytest.raises(DataLoss, match="chunk 2 on the remote tier is damaged"):
        t.get(ids[2][:1])
    assert t.get(ids[1]).data.column("traj_id").to_pylist() == [f"c1-{j}" for j in range(10)]
    store.close()


def test_dropping_a_table_while_s3_is_down_fails_whole_and_a_retry_finishes_it(tmp_path):
    s3 = s3server.start()
    bucket = s3.bucket("drop")
    store = down_s3_store(tmp_path, s3, bucket)
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=32 << 10))
    for i in range(4):
        t.insert(trajectories(10, tokens=256, id_prefix=f"a{i}"))
    demote_all(t)
    assert listed(s3, bucket)
    s3.stop()
    try:
        with pytest.raises(Unavailable, match="remote tier"):
            store.drop_table("t")
        assert "t" in store and t.stats()["items"] == 40  # closed, its data whole
        s3 = s3server.start(int(s3.endpoint.rsplit(":", 1)[1]))
        store.drop_table("t")
        assert "t" not in store and listed(s3, bucket) == []
        assert list(store.db.cf["chunks"].keys()) == [] and list(store.db.cf["journal"].keys()) == []
        assert not [cf for cf in store.db.cf if cf.startswith("chunks.")]  # the table's family is gone
    finally:
        store.close()
        s3.stop()


class Panic(BaseException):
    """What a panic inside a native library (pyo3's PanicException) looks like to Python."""


def test_the_mover_survives_a_panic_in_a_pass_and_demotes_on_the_next(tmp_path, monkeypatch):
    store = Catalog(tmp_path / "d", remote=lambda name: RemoteTier(f"file://{tmp_path}/remote", name))
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1 << 20, ssd_bytes=256 << 10))
    demote, panics = t.demote, []

    def panic_once():
        if not panics:
            panics.append(1)
            raise Panic("called `Option::unwrap()` on a `None` value")
        return demote()
    monkeypatch.setattr(t, "demote", panic_once)
    try:
        for i in range(4):
            t.insert(trajectories(32, tokens=1024, id_prefix=f"p{i}"))
        store.start_mover(interval_s=0.05, max_backoff_s=0.2)
        wait_until(lambda: panics and t.stats()["items_remote"] > 0)  # a later pass demoted
    finally:
        store.close()
