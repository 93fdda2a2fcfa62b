"""Checkpoints in process (no gRPC): remote datasets copied as of the checkpoint's instant
and restored whole after the live server freed and cleaned them; a restore that never
writes outside its data dir and remote tier, whatever a crafted seal or descriptor says;
cleanup that removes only what the failing call created."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import lance
import pytest

from expstore import checkpoint
from expstore.checkpoint import Checkpointer
from expstore.errors import DataLoss, FailedPrecondition, Unavailable
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.tiers.remote import SealedObjects, RemoteTier


def open_store(data: Path, remote: SealedObjects) -> Catalog:
    return Catalog(data, seed=0, remote=lambda name: RemoteTier(remote.uri, name))


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def traj_ids(table) -> list[str]:
    """Every live item's traj_id, read from whichever tier holds it."""
    return sorted(v for batch in table.scan(["traj_id"]) for v in batch.column("traj_id").to_pylist())


@pytest.fixture
def live(tmp_path):
    """A store whose table ``t`` has chunks on the remote tier and an archive."""
    remote = SealedObjects((tmp_path / "remote-a").as_uri())
    store = open_store(tmp_path / "a", remote)
    t = store.create_table(TableSpec("t", tiers="remote", archive=True, ssd_bytes=100_000, memory_bytes=1 << 20,
                                     max_size=150, sampler=SamplerSpec("fifo")))
    for i in range(6):
        t.insert(trajectories(32, tokens=256, seed=i, id_prefix=f"b{i}"))
        while t.demote() + t.archive_pending():
            pass
    assert t.stats()["remote_chunks"] >= 2 and t.stats()["archived_items"] > 0
    yield store, remote
    store.close()


def test_remote_datasets_are_copied_and_restore_after_the_live_server_cleaned_them(live, tmp_path):
    store, remote = live
    t = store.table("t")
    rows = traj_ids(t)
    archived = sorted(t.scan_archive(["traj_id"]).read_all().column("traj_id").to_pylist())
    info = Checkpointer(store, remote).create("c1")
    # The live server frees every chunk and Lance removes the files at once.
    store.drop_table("t")
    for name in ("t", "t.archive"):
        ds = lance.dataset(str(tmp_path / "remote-a" / "tables" / f"{name}.lance"))
        assert not ds.get_fragments()
        ds.cleanup_old_versions(older_than=timedelta(0), delete_unverified=True)
    assert not any((tmp_path / "remote-a" / "tables" / "t.lance" / "data").iterdir())

    own = SealedObjects((tmp_path / "remote-b").as_uri())
    source, name = checkpoint.locate(info.uri, own)
    checkpoint.restore(source, name, tmp_path / "b", own)
    restored = open_store(tmp_path / "b", own)
    t = restored.table("t")
    assert t.stats()["remote_chunks"] >= 2
    assert traj_ids(t) == rows
    assert sorted(t.scan_archive(["traj_id"]).read_all().column("traj_id").to_pylist()) == archived
    restored.close()


def test_a_restore_into_the_remote_tier_it_was_taken_from_is_refused(live, tmp_path):
    store, remote = live
    info = Checkpointer(store, remote).create("c1")
    spelled_otherwise = SealedObjects(str(tmp_path / "remote-a") + "/")
    for target in (remote, spelled_otherwise):
        with pytest.raises(FailedPrecondition, match="needs a remote tier of its own"):
            checkpoint.restore(*checkpoint.locate(info.uri, target), tmp_path / "b", target)
    # Another remote tier that already holds one of its datasets: refused as well.
    other = SealedObjects((tmp_path / "remote-c").as_uri())
    RemoteTier(other.uri, "t.archive").put(0, trajectories(2).to_batches()[0])
    before = files_under(tmp_path / "remote-c")
    with pytest.raises(FailedPrecondition, match="already holds tables/t.archive.lance"):
        checkpoint.restore(*checkpoint.locate(info.uri, other), tmp_path / "b", other)
    assert not (tmp_path / "b" / "rocksdb").exists() and files_under(tmp_path / "remote-c") == before


def test_inserts_go_on_during_a_checkpoint_and_what_they_acked_before_it_restores(live, tmp_path):
    store, remote = live
    t = store.table("t")
    stop, acked, errors = threading.Event(), [], []

    def produce():
        i = 0
        while not stop.is_set():
            try:
                t.insert(trajectories(4, tokens=64, seed=100 + i, id_prefix=f"during{i}"))
                acked.append(i)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return
            i += 1

    writer = threading.Thread(target=produce)
    writer.start()
    info = Checkpointer(store, remote).create("c1")
    stop.set()
    writer.join()
    assert not errors and acked
    own = SealedObjects((tmp_path / "remote-b").as_uri())
    checkpoint.restore(*checkpoint.locate(info.uri, own), tmp_path / "b", own)
    restored = open_store(tmp_path / "b", own)
    ids = traj_ids(restored.table("t"))
    assert len(ids) == len(set(ids)) and all(i.startswith(("b", "during")) for i in ids)
    restored.close()


def crafted(tmp_path: Path, seal: dict, descriptor: dict | None = None) -> SealedObjects:
    """A sealed checkpoint 'evil' whose _SEALED (and checkpoint.json) say what we like."""
    root = tmp_path / "remote-x" / "checkpoints" / "evil"
    (root / "rocksdb").mkdir(parents=True)
    (root / "rocksdb" / "CURRENT").write_text("MANIFEST-000001\n")
    if descriptor is not None:
        (root / "checkpoint.json").write_text(json.dumps(descriptor))
    (root / "_SEALED").write_text(json.dumps({"files": seal}))
    return SealedObjects((tmp_path / "remote-x").as_uri())


@pytest.mark.parametrize("path", ["../../x", "rocksdb/../../../x", "/tmp/expstore-abs-x", "rocksdb//x", "./x", ""])
def test_a_seal_listing_a_path_outside_its_prefix_is_refused_and_nothing_is_written(tmp_path, path):
    source = crafted(tmp_path, {"rocksdb/CURRENT": 16, path: 16}, {"remote_uri": "s3://elsewhere", "datasets": {}})
    before = files_under(tmp_path)
    own = SealedObjects((tmp_path / "remote-b").as_uri())
    with pytest.raises(DataLoss, match="not a relative path inside its directory"):
        checkpoint.restore(source, "evil", tmp_path / "data" / "b", own)
    with pytest.raises(DataLoss, match="not a relative path inside its directory"):
        source.get_dir("checkpoints/evil", tmp_path / "data" / "c")
    assert files_under(tmp_path) == before
    assert not Path("/tmp/expstore-abs-x").exists()


@pytest.mark.parametrize("dataset", ["../../x", "tables/../../x.lance", "/abs/t.lance", "tables/a/b.lance", "x"])
def test_a_descriptor_naming_something_other_than_a_dataset_is_refused(tmp_path, dataset):
    source = crafted(tmp_path, {"rocksdb/CURRENT": 16, "checkpoint.json": 0},
                     {"remote_uri": "s3://elsewhere", "datasets": {dataset: 1}})
    (tmp_path / "remote-x" / "checkpoints" / "evil" / "_SEALED").write_text(json.dumps({"files": {
        "rocksdb/CURRENT": 16,
        "checkpoint.json": (tmp_path / "remote-x" / "checkpoints" / "evil" / "checkpoint.json").stat().st_size}}))
    before = files_under(tmp_path)
    with pytest.raises(DataLoss, match="not a remote dataset"):
        checkpoint.restore(source, "evil", tmp_path / "b", SealedObjects((tmp_path / "remote-b").as_uri()))
    assert files_under(tmp_path) == before


def test_a_failed_restore_removes_what_it_wrote_and_nothing_else(live, tmp_path):
    store, remote = live
    info = Checkpointer(store, remote).create("c1")
    copied = next((tmp_path / "remote-a" / "checkpoints" / "c1" / "tables" / "t.lance" / "data").iterdir())
    copied.unlink()
    copied.write_bytes(b"short")  # not the size its seal lists
    own = SealedObjects((tmp_path / "remote-b").as_uri())
    (tmp_path / "remote-b" / "tables" / "other.lance").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    with pytest.raises(DataLoss, match="its seal says"):
        checkpoint.restore(*checkpoint.locate(info.uri, own), tmp_path / "b", own)
    assert files_under(tmp_path / "b") == {"keep.txt"}
    assert files_under(tmp_path / "remote-b") == {"tables", "tables/other.lance"}


def test_a_failing_checkpoint_removes_only_its_own_work(live, tmp_path):
    store, remote = live
    (tmp_path / "a" / "checkpoints" / "keep").mkdir(parents=True)
    (tmp_path / "a" / "checkpoints" / "keep" / "f").write_text("not the checkpointer's")
    (tmp_path / "remote-a" / "checkpoints").write_text("")  # a file: every upload fails
    data_before = files_under(tmp_path / "a" / "rocksdb")
    with pytest.raises(Unavailable, match="checkpoints/c1"):
        Checkpointer(store, remote).create("c1")
    assert files_under(tmp_path / "a" / "checkpoints") == {"keep", "keep/f"}
    assert files_under(tmp_path / "a" / "rocksdb") >= {f for f in data_before if f.endswith(".sst")}
    t = store.table("t")
    t.insert(trajectories(3, tokens=8, id_prefix="after"))
    assert "after-0" in traj_ids(t)


def test_other_threads_run_while_a_checkpoint_flushes_the_memtables(tmp_path):
    """rocksdict's create_checkpoint holds the GIL while RocksDB flushes; the flush the
    checkpoint runs first must not: a thread polling RocksDB sees the flush running."""
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", max_size=10**6))
    for i in range(28):  # ~20 MB in the memtable, in chunks small enough for RocksDB (not files)
        t.insert(trajectories(20, tokens=4096, seed=i, id_prefix=f"m{i}"))
    chunks = store.db.cf[t.parts.placement.ssd.family]
    assert chunks.property_int_value("rocksdb.cur-size-active-mem-table") > 10 << 20
    stop, seen = threading.Event(), []

    def poll():
        while not stop.is_set():
            seen.append(chunks.property_int_value("rocksdb.num-running-flushes"))

    poller = threading.Thread(target=poll)
    poller.start()
    store.db.checkpoint(tmp_path / "ckpt")
    stop.set()
    poller.join()
    assert max(seen) > 0, "no other thread ran while the memtable was flushed"
    assert chunks.property_int_value("rocksdb.cur-size-active-mem-table") < 1 << 20
    store.close()
