"""Durable tables: a random sequence of every kind of change, interrupted by snapshots at
random moments, restores to exactly the state the table had (ids, chunk locations,
priorities, times_sampled, versions, keys, consumer groups, cuts, rate limiter)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from rocksdict import WriteBatch

from expstore import codec, movement
from expstore.chunks import ChunkStore
from expstore.errors import DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted
from expstore.journal import Journal, pack, unpack
from expstore.spec import RateLimiterSpec, SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.tiers.remote import RemoteTier
from expstore.tiers.rocks import Database, Layout, RocksTier, block_offsets, open_rocks_tier, table_prefix

pytestmark = pytest.mark.timeout(120)


def state(table) -> dict:
    table.wait_for_background()  # a compaction under way re-points items when it ends
    ix = table.parts.index
    live = ix.live_slots()
    s = {name: ix[name][live].copy() for name in ("id", "chunk", "row", "priority", "times_sampled",
                                                   "policy_version", "group_size", "reward", "touched")}
    s["group"] = [table.parts.groups.name(c) if c >= 0 else None for c in ix["group"][live]]
    s["task"] = [table.parts.tasks.name(c) if c >= 0 else None for c in ix["task"][live]]
    s["keys"] = table.parts.keys.keys_of(live)
    s["removed"] = table.parts.keys.removed()[0].to_pylist()
    s["next_id"] = ix.next_id
    s["touches"] = table.touches
    s["version"] = table.policy_version
    s["limiter"] = {k: table.parts.limiter.state()[k] for k in ("inserts", "samples", "deletes")}
    s["allowance"] = table.allowance
    s["groups"] = {n: {k: v for k, v in g.to_dict(0.0).items() if k != "deadlines"}
                   for n, g in table.parts.consumers.items()}
    s["eligible"] = len(table.parts.sampler)
    return s


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


SPECS = [
    dict(sampler=SamplerSpec("prioritized", alpha=0.8), max_size=300, max_times_sampled=4),
    dict(sampler=SamplerSpec("fifo"), max_size=200, remover="fifo", max_staleness=2),
    dict(sampler=SamplerSpec("group", group_size=4), max_size=400, remover="min_priority"),
    dict(sampler=SamplerSpec("uniform"), max_size=250, dedup_window=50,
         rate_limiter=RateLimiterSpec("sample_to_insert_ratio", samples_per_insert=4.0,
                                      min_size_to_sample=1, error_buffer=10_000)),
]


@pytest.mark.parametrize("seed", range(len(SPECS)))
def test_random_changes_and_snapshots_restore_exactly(tmp_path, monkeypatch, seed):
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(Journal, "wants_snapshot", lambda self: rng.random() < 0.05)
    store = Catalog(tmp_path / "d", seed=seed)
    spec = TableSpec("t", memory_bytes=200_000, **SPECS[seed])
    t = store.create_table(spec)
    version, n_inserted = 0, 0
    for step in range(120):
        op = rng.choice(["insert", "insert", "sample", "priority", "version", "stream", "ack", "nack", "cut", "retry"])
        live = t.parts.index["id"][t.parts.index.live_slots()]
        try:
            if op == "insert":
                n = int(rng.choice([4, 8, 12]))
                t.insert(trajectories(n, tokens=int(rng.integers(8, 64)), groups=n // 4, seed=n_inserted,
                                      id_prefix=f"s{n_inserted}", policy_version=version),
                         priorities=rng.random(n) + 0.1, timeout=0)
                n_inserted += n
            elif op == "retry" and n_inserted:
                t.insert(trajectories(4, tokens=8, groups=1, seed=0, id_prefix="s0"), timeout=0)
            elif op == "sample":
                t.sample(8, timeout=0, step=step)
            elif op == "priority" and len(live):
                pick = rng.choice(live, size=min(5, len(live)), replace=False)
                t.update_priorities(pick, rng.random(len(pick)) + 0.1)
            elif op == "version":
                version += 1
                t.set_policy_version(version)
            elif op == "stream":
                t.stream("g", 6, timeout=0, visibility_timeout=float(rng.choice([0.001, 600])))
            elif op in ("ack", "nack", "cut") and "g" in t.parts.consumers and len(t.parts.consumers["g"].inflight_ids):
                ids = t.parts.consumers["g"].inflight_ids[:3]
                if op == "cut":
                    t.commit_cut("g", step, ids, tag=f"c{step}")
                else:
                    getattr(t, op)("g", ids)
        except DeadlineExceeded:  # rate limiter, sampler or stream not ready: nothing changed
            pass
    before = state(t)
    data = t.get(before["id"]).data if len(before["id"]) else None
    store.close()

    store = Catalog(tmp_path / "d", seed=seed)
    t = store.table("t")
    assert_same(before, state(t))
    if data is not None:
        assert t.get(before["id"]).data.equals(data)
    # The restored table goes on: new ids continue, chunks are accounted for.
    r = t.insert(trajectories(4, tokens=8, groups=1, seed=999, id_prefix="after"))
    assert r.num_inserted == 0 or int(r.item_ids.min()) >= before["next_id"]
    store.close()


@pytest.mark.parametrize("snapshot", [False, True])
def test_nacked_items_are_due_after_a_restart(tmp_path, monkeypatch, snapshot):
    """A nack is journaled: after a restart the items it handed back come first, long
    before the visibility timeout of their delivery."""
    take = {"now": False}
    monkeypatch.setattr(Journal, "wants_snapshot", lambda self: take["now"])
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", sampler=SamplerSpec("fifo"), max_size=100))
    t.insert(trajectories(6, tokens=8))
    assert t.stream("g", 4, timeout=0, visibility_timeout=600).item_ids.tolist() == [1, 2, 3, 4]
    assert t.nack("g", [2, 3]) == 2
    take["now"] = snapshot
    t.ack("g", [1])  # a change: the snapshot, if wanted, is written here
    store.close()
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert t.stream("g", 3, timeout=0, visibility_timeout=600).item_ids.tolist() == [2, 3, 5]
    store.close()


@pytest.mark.parametrize("snapshot", [False, True])
def test_heap_tie_order_survives_a_restart(tmp_path, monkeypatch, snapshot):
    """Ties go to the least recently inserted or updated item; replaying the journal, from
    the start or from a snapshot taken between updates, must give the same order."""
    take = {"now": False}
    monkeypatch.setattr(Journal, "wants_snapshot", lambda self: take["now"])
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", sampler=SamplerSpec("max_heap"), remover="min_priority", max_size=6))
    ids = t.insert(trajectories(6, tokens=8), priorities=[1.0] * 6).item_ids.tolist()
    t.update_priorities([ids[0], ids[3]], [1.0, 1.0])
    t.update_priorities([ids[4]], [2.0])
    t.update_priorities([ids[4]], [1.0])
    take["now"] = snapshot
    t.set_policy_version(1)  # a change: the snapshot, if wanted, is written here
    take["now"] = False
    t.update_priorities([ids[1]], [1.0])
    expected = [ids[2], ids[5], ids[0], ids[3], ids[4], ids[1]]
    assert t.sample(6).item_ids.tolist() == expected
    store.close()

    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert t.sample(6).item_ids.tolist() == expected
    new = t.insert(trajectories(1, tokens=8, id_prefix="new"), priorities=[3.0]).item_ids.tolist()
    assert t.sample(6).item_ids.tolist() == new + expected[1:]  # the remover took expected[0]
    store.close()


def test_a_crash_loses_only_inserts_acknowledged_at_durability_memory_and_whole(tmp_path):
    crash = f"""
import os
from expstore.catalog import Catalog
from expstore.spec import TableSpec
from expstore.synthetic import trajectories
from expstore.tiers.remote import RemoteTier
t = Catalog({str(tmp_path / "d")!r}).create_table(TableSpec("t"))
t.insert(trajectories(5, id_prefix="wal"), durability="wal")
t.insert(trajectories(5, id_prefix="mem"), durability="memory")
os._exit(0)  # like kill -9: no close, RocksDB's memtable never reaches disk
"""
    out = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    keys = sorted(t.parts.keys.keys_of(t.parts.index.live_slots()))
    assert keys == [f"wal-{i}" for i in range(5)], keys  # the memory-durability rows are gone whole
    assert store.restored["t"]["lost"] == 0  # no index entry without its payload
    assert t.get(t.parts.index["id"][t.parts.index.live_slots()]).data.num_rows == 5
    store.close()


def remove_chunk(data_dir, table_id: int, chunk: int) -> list[tuple[bytes, bytes]]:
    """Delete a chunk's keys from a closed data dir (as a lost disk block or a wrong remote
    tier would); returns them, to put back."""
    db = Database(data_dir)
    prefix = table_prefix(table_id) + chunk.to_bytes(8, "big")
    tier = RocksTier(db, table_id)
    saved = list(db.items(tier.family, prefix))
    assert saved
    tier.delete([chunk])
    db.close()
    return saved


def put_back(data_dir, saved: list[tuple[bytes, bytes]]) -> None:
    db = Database(data_dir)
    wb = WriteBatch(raw_mode=True)
    for key, value in saved:
        wb.put(key, value, db.handle[RocksTier(db, int.from_bytes(key[:4], "big")).family])
    db.write(wb)
    db.close()


@pytest.mark.parametrize("snapshot", [False, True])
def test_items_acknowledged_at_wal_whose_chunk_is_gone_are_data_loss_never_dropped(tmp_path, monkeypatch, snapshot):
    """Only items acknowledged at durability memory may vanish in a crash; a chunk of an
    insert acknowledged at wal that is in no tier is reported and nothing is dropped (from
    the journal's records, or from a snapshot of them)."""
    monkeypatch.setattr(Journal, "wants_snapshot", lambda self: snapshot)
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t"))
    wal = t.insert(trajectories(5, id_prefix="wal"), durability="wal").item_ids
    mem = t.insert(trajectories(5, id_prefix="mem"), durability="memory").item_ids
    live = t.parts.index.live_slots()
    chunk_of = dict(zip(t.parts.index["id"][live].tolist(), t.parts.index["chunk"][live].tolist()))
    table_id = t.storage.table_id
    store.close()

    saved = remove_chunk(tmp_path / "d", table_id, chunk_of[int(wal[0])])
    store = Catalog(tmp_path / "d")  # the table stays closed, its data kept
    with pytest.raises(DataLoss, match=r"table 't': 5 items acknowledged at durability 'wal' or 'fsync' "
                                       r"reference 1 chunks that are in no tier .* nothing was dropped"):
        store.table("t")
    store.close()
    put_back(tmp_path / "d", saved)
    remove_chunk(tmp_path / "d", table_id, chunk_of[int(mem[0])])
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert store.restored["t"]["lost"] == 5 and t.stats()["items"] == 5
    assert t.get(wal).data.column("traj_id").to_pylist() == [f"wal-{i}" for i in range(5)]
    store.close()


def test_a_corrupt_block_is_data_loss_naming_the_chunk_never_rows(tmp_path):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", memory_bytes=1))  # nothing stays cached in memory
    ids = t.insert(trajectories(20, tokens=64, id_prefix="c")).item_ids
    assert t.stats()["items_ssd"] == 20
    cf = store.db.cf[t.parts.placement.ssd.family]
    key = next(k for k in cf.keys() if not k.endswith(b"\xff\xff\xff\xff"))
    value = bytearray(cf[key])
    value[len(value) // 2] ^= 0xFF
    cf[key] = bytes(value)
    with pytest.raises(DataLoss, match="table 't': SSD tier, table id 1, chunk 0, block 0: checksum mismatch"):
        t.get(ids)
    with pytest.raises(DataLoss, match="item 1 is quarantined: its chunk 0 on the ssd tier is damaged"):
        t.get(ids)  # quarantined: never read again, never returned
    assert t.stats()["quarantined_items"] == 20 and t.stats()["items"] == 0
    with pytest.raises(DeadlineExceeded):
        t.sample(1, timeout=0)
    store.close()


def test_large_rows_share_blocks_and_random_rows_read_back_exactly_from_them(tmp_path):
    """36 KiB rows are stored two to a block (the whole rows nearest BLOCK_BYTES, not one
    block per row); a random selection reads back exactly, after a restart too, and a
    damaged block names its table, chunk and block and quarantines just its two rows."""
    data = trajectories(64, tokens=4096, id_prefix="big")
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", memory_bytes=1))  # every read goes to the SSD tier
    ids = t.insert(data).item_ids
    ssd = t.parts.placement.ssd
    assert ssd.layout(0).offsets.tolist() == list(range(0, 65, 2))
    expected = data.to_pylist()

    def got(which: np.ndarray) -> list[dict]:
        return t.get(ids[which]).data.select(data.column_names).to_pylist()

    pick = np.random.default_rng(0).permutation(64)[:25]  # both rows of some blocks, one of others
    assert got(pick) == [expected[i] for i in pick.tolist()]
    store.close()

    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert got(pick) == [expected[i] for i in pick.tolist()]
    ssd = t.parts.placement.ssd
    lo, hi = ssd.layout(0).positions[5:7].tolist()  # a 2.4 MB chunk: its blocks are in a file
    with open(ssd.file_of(0), "r+b") as f:  # rows 10 and 11
        f.seek((lo + hi) // 2)
        byte = f.read(1)[0]
        f.seek((lo + hi) // 2)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(DataLoss, match="table 't': SSD tier, table id 1, chunk 0, block 5: checksum mismatch") as e:
        t.get(ids)
    assert e.value.damage == {0: [(10, 12)]}
    assert t.stats()["quarantined_items"] == 2
    healthy = np.r_[0:10, 12:64]
    assert got(healthy) == [expected[i] for i in healthy.tolist()]
    store.close()

def test_an_ssd_tier_keeps_one_schema_object_per_schema_and_counts_each_chunk_once(tmp_path):
    """Chunks of one schema share one decoded schema, whether put or read back after a
    restart; a put of a held id replaces it, and the byte counters add up its chunks'."""
    batches = [trajectories(8, seed=i).combine_chunks().to_batches()[0] for i in range(3)]
    other = pa.record_batch({"x": pa.array([1, 2], pa.int64())})
    tier = open_rocks_tier(tmp_path / "r", "t")
    for c, batch in enumerate([*batches, other]):
        tier.put(c, batch)
    tier.put(1, batches[1])  # replaces chunk 1: counted once
    for reopened in (False, True):
        layouts = [tier.layout(c) for c in range(4)]
        assert len({id(layout.schema) for layout in layouts[:3]}) == 1, reopened
        assert layouts[3].schema is not layouts[0].schema and layouts[3].schema.names == ["x"]
        assert tier.nbytes == sum(layout.arrow for layout in layouts) == sum(map(tier.size_of, range(4)))
        assert tier.stored_nbytes == sum(layout.stored for layout in layouts)
        assert len(tier) == 4 and tier.rows_of(3) == 2
        tier.close()
        tier = open_rocks_tier(tmp_path / "r", "t")
    tier.delete([0, 3])
    assert len(tier) == 2 and 3 not in tier and tier.nbytes == sum(map(tier.size_of, (1, 2)))
    tier.close()



def test_journal_records_round_trip():
    fields = {"ids": np.arange(5, dtype=np.uint64), "stored": np.array([True, False]), "keys": ["a", "b"],
              "groups": None, "n": 3, "reason": "max_size", "deadline": 1.5}
    kind, back = unpack(pack("insert", fields))
    assert kind == "insert" and back.keys() == fields.keys()
    for k, v in fields.items():
        assert np.array_equal(back[k], v) if isinstance(v, np.ndarray) else back[k] == v


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=6), st.one_of(
    st.lists(st.text()), st.lists(st.one_of(st.none(), st.text())), st.lists(st.integers()), st.integers(), st.text()),
    max_size=5))
def test_journal_records_round_trip_any_lists(fields):
    fields["ids"] = np.arange(3, dtype=np.uint64)  # arrays and string lists share the record's tail
    kind, back = unpack(pack("insert", fields))
    assert kind == "insert" and back.keys() == fields.keys()
    for k, v in fields.items():
        assert np.array_equal(back[k], v) if isinstance(v, np.ndarray) else back[k] == v


def test_journal_records_written_with_string_lists_in_the_header_still_read():
    header = json.dumps({"k": "insert", "s": {"n": 3}, "t": {"keys": ["a", "\u00e9"]},
                         "a": [["ids", "<u8", 2]]}).encode()
    kind, back = unpack(len(header).to_bytes(4, "little") + header + np.arange(2, dtype="<u8").tobytes())
    assert (kind, back["keys"], back["ids"].tolist(), back["n"]) == ("insert", ["a", "\u00e9"], [0, 1], 3)


def test_disk_full_is_resource_exhausted_and_applies_nothing(tmp_path):
    store = Catalog(tmp_path / "d", min_free_bytes=1 << 62)  # "full" whatever the disk
    t = store.create_table(TableSpec("t"))
    with pytest.raises(ResourceExhausted, match="disk of data dir .* is full"):
        t.insert(trajectories(3, id_prefix="x"))
    assert len(t) == 0 and t.stats()["ssd_bytes"] == 0
    store.db.min_free_bytes = 0
    assert t.insert(trajectories(3, id_prefix="x")).num_inserted == 3
    store.close()


def test_durable_tiers_need_a_data_dir():
    with pytest.raises(FailedPrecondition, match="needs a data dir"):
        Catalog().create_table(TableSpec("t", tiers="ssd"))
    assert Catalog().create_table(TableSpec("t")).spec.tiers == "memory"


def test_drop_table_deletes_its_data_and_a_new_table_of_that_name_starts_empty(tmp_path):
    store = Catalog(tmp_path / "d")
    store.create_table(TableSpec("t")).insert(trajectories(10, id_prefix="x"))
    family = store.table("t").parts.placement.ssd.family
    store.drop_table("t")
    assert family not in store.db.cf  # its chunks' column family is gone, files and all
    assert list(store.db.cf["chunks"].keys()) == [] and list(store.db.cf["journal"].keys()) == []
    t = store.create_table(TableSpec("t"))
    assert t.insert(trajectories(10, id_prefix="x")).num_inserted == 10
    store.close()
    assert len(Catalog(tmp_path / "d").table("t")) == 10


def test_archive_moves_items_that_leave_the_window_to_the_remote_tier(tmp_path):
    uri = (tmp_path / "remote").as_uri()
    open_store = lambda: Catalog(tmp_path / "d", remote=lambda name: RemoteTier(uri, name))  # noqa: E731
    store = open_store()
    t = store.create_table(TableSpec("t", tiers="remote", archive=True, max_size=30, sampler=SamplerSpec("fifo")))
    for i in range(4):
        t.insert(trajectories(10, id_prefix=f"a{i}"))
    t.set_policy_version(1)
    assert len(t) == 30 and t.stats()["removed_max_size"] == 10
    assert t.archive_pending() == 1 and t.archive_pending() == 0
    archived = RemoteTier(uri, "t.archive").scan(columns=["traj_id", "_item_id", "_removed"]).read_all()
    assert archived.column("traj_id").to_pylist() == [f"a0-{i}" for i in range(10)]
    assert archived.column("_item_id").to_pylist() == list(range(1, 11))
    assert set(archived.column("_removed").to_pylist()) == {"max_size"}
    # Removed but not yet archived when the server stops: archived after the restart.
    t.insert(trajectories(10, id_prefix="a4"))
    store.close()
    store = open_store()
    t = store.table("t")
    assert t.archive_pending() == 1
    archived = RemoteTier(uri, "t.archive").scan(columns=["traj_id"]).read_all().column("traj_id").to_pylist()
    assert sorted(archived) == sorted([f"a0-{i}" for i in range(10)] + [f"a1-{i}" for i in range(10)])
    assert list(store.db.cf[t.parts.placement.ssd.family].keys()) and t.stats()["items"] == 30
    store.close()


def test_scan_yields_live_items_with_server_columns_pruned_by_the_index(tmp_path):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", memory_bytes=1))  # payloads come from the SSD tier
    for v in range(3):
        t.insert(trajectories(10, tokens=8, id_prefix=f"v{v}", policy_version=v))
    t.sample(5)
    batches = list(t.scan(["traj_id", "policy_version"], min_policy_version=1))
    got = pa.Table.from_batches(batches)
    assert got.column_names == ["traj_id", "policy_version", "item_id", "priority", "times_sampled",
                                "inserted_at", "tier"]
    assert got.column("traj_id").to_pylist() == [f"v{v}-{i}" for v in (1, 2) for i in range(10)]
    assert got.column("item_id").to_pylist() == list(range(11, 31))
    assert set(got.column("tier").to_pylist()) == {"ssd"}
    assert sum(got.column("times_sampled").to_pylist()) <= 5
    with pytest.raises(InvalidArgument, match="no column 'nope'"):
        list(t.scan(["nope"]))
    assert not t.parts.placement.pinned()  # a finished scan holds nothing
    store.close()


def test_a_stream_reads_ahead_only_what_the_cache_can_hold(tmp_path):
    """Chunks read ahead into a cache too small for them would be evicted before the
    stream reads them, and read again: a cache under twice their size gets none."""
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", sampler=SamplerSpec("fifo"), memory_bytes=100_000))  # chunks: ~77 KB
    for i in range(4):
        t.insert(trajectories(16, tokens=512, id_prefix=f"c{i}"))
    store.close()
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    ids = [int(i) for _ in range(4) for i in t.stream("g", 16).item_ids]
    t.wait_for_background()
    assert ids == list(range(1, 65)) and t.stats()["prefetched"] == 0
    store.close()


def test_a_cold_stream_reads_ahead_into_memory(tmp_path):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", sampler=SamplerSpec("fifo"), memory_bytes=600_000))
    for i in range(8):
        t.insert(trajectories(16, tokens=512, id_prefix=f"c{i}"))
    store.close()
    store = Catalog(tmp_path / "d")  # restarted: the memory cache is cold
    t = store.table("t")
    assert t.stats()["memory_chunks"] == 0
    first = t.stream("g", 16)
    t.wait_for_background()  # the read-ahead has run
    assert t.stats()["prefetched"] >= 1
    nxt = int(t.parts.index["chunk"][t.parts.index.lookup(np.array([first.item_ids[-1] + 1]))][0])
    assert t.parts.placement.resident(nxt)
    ids = [int(i) for _ in range(7) for i in t.stream("g", 16).item_ids]
    t.wait_for_background()  # the last read-ahead has run too
    assert ids == list(range(17, 129)) and not t.parts.placement.pinned()
    store.close()


def held_compaction(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(copying, go): the first compaction pass signals ``copying`` as it starts copying
    rows (outside the table lock) and waits for ``go``; later passes run at once. The
    insert that starts it waits for it too: start that one with ``in_thread``."""
    copying, go, real = threading.Event(), threading.Event(), movement.take_rows

    def take_rows(*args):
        if not copying.is_set():
            copying.set()
            assert go.wait(30)
        return real(*args)
    monkeypatch.setattr(movement, "take_rows", take_rows)
    return copying, go


def insert_small(t, prefix: str, n: int = 8):
    return t.insert(trajectories(n, tokens=16, groups=0, seed=0, id_prefix=prefix)).item_ids


def small_traj_ids(prefixes) -> list[str]:
    """The traj_ids of 8-row ``insert_small`` calls with ``prefixes``, in order."""
    return [f"{p}-{k}" for p in prefixes for k in range(8)]


def in_thread(fn, *args) -> Future:
    return ThreadPoolExecutor(1).submit(fn, *args)


def merging_table(tmp_path, monkeypatch, chunks: float, **spec):
    """(store, table t, the ids of its first 8 rows "a", copying, go): a durable table
    holding one small chunk, whose merges start once ``chunks`` times its bytes of small
    chunks accumulate, the first pass held (``held_compaction``)."""
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", sampler=SamplerSpec("uniform"), **spec))
    first = insert_small(t, "a")
    monkeypatch.setattr(ChunkStore, "MERGE_BYTES", int(chunks * t.stats()["memory_bytes"]))
    return (store, t, first, *held_compaction(monkeypatch))


def traj_ids_of(t, ids) -> list[str]:
    return t.get(list(ids)).data.column("traj_id").to_pylist()


def assert_no_orphans(t) -> None:
    """The table's SSD holds exactly the chunks its live items reference."""
    assert sorted(t.parts.placement.ssd.stored_chunks()) == sorted(set(state(t)["chunk"].tolist()))


def assert_restarts_the_same(store, path, before: dict, ids, expected: list[str]) -> None:
    """Close the store and open it again: table t's state, the rows of ``ids`` and the
    chunks on its SSD are as they were."""
    store.close()
    store = Catalog(path)
    t = store.table("t")
    assert_same(before, state(t))
    assert traj_ids_of(t, ids) == expected
    assert_no_orphans(t)
    store.close()


@pytest.mark.parametrize("evicted_meanwhile", [12, 24])
def test_items_that_leave_while_a_compaction_copies_their_chunks_stay_gone(tmp_path, monkeypatch, evicted_meanwhile):
    """A compaction pass copies rows outside the table lock, so calls go on meanwhile:
    items evicted then stay gone (dead rows of the new chunk, or with every item gone no
    new chunk at all), the others read back their own rows from it, before and after a
    restart, and nothing is left on the SSD that no item references."""
    store, t, first, copying, go = merging_table(tmp_path, monkeypatch, 2.5, remover="fifo", max_size=40)
    rows = {int(i): f"a-{k}" for k, i in enumerate(first)}
    rows.update((int(i), f"b-{k}") for k, i in enumerate(insert_small(t, "b")))
    third = in_thread(insert_small, t, "c")  # the third small chunk starts a pass over all three
    assert copying.wait(30)
    time.sleep(0.1)
    assert not third.done()  # that insert returns once the pass is done (the others go on)
    monkeypatch.setattr(ChunkStore, "MERGE_BYTES", 1 << 40)  # no second pass
    for p in ("d", "e", "f"):  # fifo evicts chunk a (24 rows in, 40 kept)
        rows.update((int(i), f"{p}-{k}") for k, i in enumerate(insert_small(t, p)))
    rest = evicted_meanwhile - 8  # and then 4 rows of b, or all of b and c
    for k in range(0, rest, 8):
        rows.update((int(i), f"g{k}-{j}") for j, i in enumerate(insert_small(t, f"g{k}", min(8, rest - k))))
    go.set()
    rows.update((int(i), f"c-{k}") for k, i in enumerate(third.result(30)))
    t.wait_for_background()
    s = t.stats()
    live = sorted(rows)[-40:]
    assert len(t) == 40 and sorted(t.parts.index["id"][t.parts.index.live_slots()].tolist()) == live
    assert (s["compactions"], s["compacted_rows"]) == ((1, 24 - evicted_meanwhile) if evicted_meanwhile < 24 else (0, 0))
    expected = [rows[i] for i in live]
    assert traj_ids_of(t, live) == expected
    assert_no_orphans(t)
    assert_restarts_the_same(store, tmp_path / "d", state(t), live, expected)


def test_a_compaction_that_cannot_write_its_chunk_changes_nothing_and_is_tried_again(tmp_path, monkeypatch, caplog):
    store, t, _, copying, go = merging_table(tmp_path, monkeypatch, 2.5)
    insert_small(t, "b")
    third = in_thread(insert_small, t, "c")
    assert copying.wait(30)
    store.db.min_free_bytes = 1 << 62  # the disk is "full" when the pass writes its chunk
    go.set()
    third.result(30)  # the insert itself was committed before the pass began
    t.wait_for_background()
    store.db.min_free_bytes = 0
    s = t.stats()
    assert (s["compactions"], s["compaction_failures"], s["chunks"]) == (0, 1, 3)
    [failure] = [r for r in caplog.records if "compaction" in r.getMessage()]
    assert failure.levelname == "WARNING" and "table 't'" in failure.getMessage()
    insert_small(t, "d")  # the next start is skipped (back-off), the one after runs
    assert t.stats()["chunks"] == 4
    insert_small(t, "e")
    t.wait_for_background()
    s = t.stats()
    assert (s["compactions"], s["compaction_failures"], s["chunks"]) == (2, 1, 1)  # a, b, c; then it, d, e
    expected = small_traj_ids("abcde")
    assert traj_ids_of(t, range(1, 41)) == expected
    assert_restarts_the_same(store, tmp_path / "d", state(t), range(1, 41), expected)


def test_an_unexpected_error_in_a_compaction_pass_is_logged_and_loses_nothing(tmp_path, monkeypatch, caplog):
    """A pass runs on a background thread whose result nobody reads: an error there that
    is not the store's own (a bug) is logged with its traceback and counted, and the
    table goes on with its chunks as they were. Passes that keep failing are started
    ever more rarely: after the first failure the next start is skipped, after the
    second the next two."""
    store, t, _, _, go = merging_table(tmp_path, monkeypatch, 2.5)
    go.set()  # no pass is held
    monkeypatch.setattr(ChunkStore, "SMALL_CHUNK_BYTES", ChunkStore.MERGE_BYTES)  # a merged chunk is not small
    real, prefixes = movement.take_rows, ["a"]

    def broken(*args):
        raise RuntimeError("a bug in the copy")

    def insert(prefix: str) -> int:
        """Insert 8 rows, wait for the pass they start, if any; the failures so far."""
        prefixes.append(prefix)
        insert_small(t, prefix)
        t.wait_for_background()
        return t.stats()["compaction_failures"]

    monkeypatch.setattr(movement, "take_rows", broken)
    # c starts a pass, which fails; d is skipped; e fails; f and g are skipped; h fails
    assert [insert(p) for p in "bcdefgh"] == [0, 1, 1, 2, 2, 2, 3]
    records = [r for r in caplog.records if "compaction" in r.getMessage()]
    assert len(records) == 3 and all(r.levelname == "ERROR" and "table 't'" in r.getMessage() for r in records)
    assert "a bug in the copy" in str(records[0].exc_info[1])
    assert (t.stats()["compactions"], t.stats()["chunks"]) == (0, 8)
    monkeypatch.setattr(movement, "take_rows", real)
    assert [insert(p) for p in "ijkl"] == [3] * 4 and t.stats()["chunks"] == 12  # skipped, after a third failure
    insert("m")
    assert t.stats()["compactions"] > 0 and t.stats()["chunks"] < 13  # passes run again
    monkeypatch.setattr(movement, "take_rows", broken)  # after a success the back-off starts afresh
    while insert(f"n{len(prefixes)}") == 3:  # small chunks accumulate until a pass starts (and fails)
        assert len(prefixes) < 40
    assert [insert(p) for p in "op"] == [4, 5]  # o is skipped, p fails
    expected = small_traj_ids(prefixes)
    ids = range(1, len(expected) + 1)
    assert traj_ids_of(t, ids) == expected
    assert_restarts_the_same(store, tmp_path / "d", state(t), ids, expected)


def test_a_table_closed_while_a_compaction_copies_rows_keeps_them_all(tmp_path, monkeypatch):
    store, t, _, copying, go = merging_table(tmp_path, monkeypatch, 1.5)
    second = in_thread(insert_small, t, "b")
    assert copying.wait(30)
    closing = threading.Thread(target=store.close)
    closing.start()
    time.sleep(0.2)  # close waits for the pass
    assert closing.is_alive()
    go.set()
    closing.join(30)
    second.result(30)
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert traj_ids_of(t, range(1, 17)) == small_traj_ids("ab")
    assert_no_orphans(t)
    store.close()


CRASH_IN_A_COMPACTION = """
import os, sys
from expstore import movement
from expstore.catalog import Catalog
from expstore.chunks import ChunkStore
from expstore.spec import SamplerSpec, TableSpec
from expstore.synthetic import trajectories

t = Catalog(sys.argv[1]).create_table(TableSpec("t", sampler=SamplerSpec("uniform")))
rows = lambda prefix: trajectories(8, tokens=16, groups=0, seed=0, id_prefix=prefix)
t.insert(rows("a"))
ChunkStore.MERGE_BYTES = int(2.5 * t.stats()["memory_bytes"])  # the third chunk starts a pass
where = {"copying": (movement, "take_rows"), "staged": (movement.Mover, "_commit_compaction"),
         "journaled": (ChunkStore, "replace")}[sys.argv[2]]
setattr(*where, lambda *args, **kwargs: os._exit(0))  # like kill -9: no close
t.insert(rows("b"))
t.insert(rows("c"))
os._exit(1)  # not reached: the pass ends the process
"""


@pytest.mark.parametrize("crash_at, chunks", [("copying", 3), ("staged", 3), ("journaled", 1)])
def test_a_crash_during_a_compaction_pass_loses_no_row_and_leaves_no_orphan(tmp_path, crash_at, chunks):
    """The process dies while a pass copies rows, once it has written the new chunk (not
    yet journaled), or once it has journaled it (the old chunks not yet freed): a restart
    finds every row in its place, in the old chunks or the new one, and removes the chunk
    that no item references."""
    out = subprocess.run([sys.executable, "-c", CRASH_IN_A_COMPACTION, str(tmp_path / "d"), crash_at],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert store.restored["t"]["lost"] == 0
    assert t.stats()["chunks"] == chunks
    expected = small_traj_ids("abc")
    assert traj_ids_of(t, range(1, 25)) == expected
    assert_no_orphans(t)
    assert_restarts_the_same(store, tmp_path / "d", state(t), range(1, 25), expected)


def legacy_block(batch: pa.RecordBatch) -> bytes:
    """A block as the SSD tier wrote them before blob files: EXK1 | crc32 | zstd(IPC message)."""
    body = zstandard.ZstdCompressor(level=1).compress(batch.serialize())
    return b"EXK1" + zlib.crc32(body).to_bytes(4, "little") + body


def legacy_encode(tier: RocksTier, chunk_id: int, batch: pa.RecordBatch):
    """RocksTier.encode as it was before blob files: legacy blocks, and a meta value of
    count | row offsets | stored bytes | Arrow bytes | schema (no checksums)."""
    n = batch.num_rows
    step = max(1, (64 << 10) // max(1, batch.get_total_buffer_size() // n))
    offsets = np.append(np.arange(0, n, step), n).astype(np.int64)
    wb, size, h = WriteBatch(raw_mode=True), 0, tier.db.handle["chunks"]
    for b, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        value = legacy_block(batch.slice(lo, hi - lo))
        wb.put(tier.block_key(chunk_id, b), value, h)
        size += len(value)
    arrow = batch.get_total_buffer_size()
    meta = len(offsets).to_bytes(4, "little") + offsets.tobytes() + size.to_bytes(8, "little") + \
        arrow.to_bytes(8, "little") + batch.schema.serialize().to_pybytes()
    wb.put(tier.block_key(chunk_id, 0xFFFFFFFF), meta, h)
    return wb, Layout(offsets, None, size, arrow, batch.schema)


def test_a_data_dir_written_in_the_legacy_block_format_reads_back_exactly(tmp_path, monkeypatch):
    """Chunks as the SSD tier wrote them before blob files and per-table column families
    (zstd + CRC blocks in the shared ``chunks`` family) are read back, and deleted."""
    data = [trajectories(20, tokens=n, id_prefix=f"o{n}-") for n in (16, 2048)]
    with monkeypatch.context() as m:
        m.setattr(RocksTier, "encode", legacy_encode)
        store = Catalog(tmp_path / "d")
        t = store.create_table(TableSpec("t"))
        old = [t.insert(d).item_ids for d in data]
        expected = rows_of(t, np.concatenate(old))  # from the memory cache
        store.close()
    raw = Database(tmp_path / "d")
    assert raw.get("chunks", [RocksTier(raw, 1).block_key(0, 0)])[0][:4] == b"EXK1"  # written the old way
    raw.close()

    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert rows_of(t, np.concatenate(old)) == expected  # from the SSD tier: the cache holds nothing
    new = t.insert(trajectories(20, tokens=2048, id_prefix="n")).item_ids  # new blocks beside the old
    assert t.sample(60).data.num_rows == 60
    store.close()
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert rows_of(t, np.concatenate(old)) == expected and t.get(new).data.num_rows == 20
    store.drop_table("t")
    assert list(store.db.cf["chunks"].keys()) == []
    store.close()


def crc32_encode(tier: RocksTier, chunk_id: int, batch: pa.RecordBatch):
    """RocksTier.encode as it was before CRC32C: IPC blocks whose zlib CRC32s the meta value
    records after the magic EXM2 (count | row offsets | CRC32s | stored | Arrow | schema)."""
    offsets = block_offsets(batch.num_rows, batch.get_total_buffer_size())
    wb, size, h, crcs = WriteBatch(raw_mode=True), 0, tier.db.handle[tier.family], []
    for b, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        value = batch.slice(lo, hi - lo).serialize().to_pybytes()
        crcs.append(zlib.crc32(value))
        wb.put(tier.block_key(chunk_id, b), value, h)
        size += len(value)
    arrow = batch.get_total_buffer_size()
    meta = b"EXM2" + len(offsets).to_bytes(4, "little") + offsets.astype("<i8").tobytes() + \
        np.array(crcs, "<u4").tobytes() + size.to_bytes(8, "little") + arrow.to_bytes(8, "little") + \
        batch.schema.serialize().to_pybytes()
    wb.put(tier.block_key(chunk_id, 0xFFFFFFFF), meta, h)
    return wb, Layout(offsets, np.array(crcs, np.uint32), size, arrow, batch.schema, "crc32")


def test_blocks_are_checked_with_crc32c_and_chunks_checked_with_crc32_still_read(tmp_path, monkeypatch):
    """New chunks record CRC32C block checksums (meta magic EXM3); chunks written with zlib's
    CRC32 (EXM2) read back exactly after a restart, and a damaged block of either kind is
    DATA_LOSS naming it."""
    data = [trajectories(20, tokens=n, id_prefix=f"o{n}-") for n in (16, 4096)]
    with monkeypatch.context() as m:
        m.setattr(RocksTier, "encode", crc32_encode)
        store = Catalog(tmp_path / "d")
        t = store.create_table(TableSpec("t", memory_bytes=1))  # reads come from the SSD tier
        old = [t.insert(d).item_ids for d in data]
        expected = rows_of(t, np.concatenate(old))
        store.close()
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    new = t.insert(trajectories(20, tokens=4096, id_prefix="n")).item_ids
    tier = t.parts.placement.ssd
    cf = store.db.cf[tier.family]
    metas = {int.from_bytes(k[4:12], "big"): v for k, v in cf.items() if k.endswith(b"\xff\xff\xff\xff")}
    assert [metas[c][:4] for c in sorted(metas)] == [b"EXM2", b"EXM2", b"EXM3"]
    block = cf[tier.block_key(2, 0)]
    assert Layout.decode(metas[2]).checksums[0] == codec.block_checksum(block) != zlib.crc32(block)
    assert rows_of(t, np.concatenate(old)) == expected and t.get(new).data.num_rows == 20
    store.close()

    for chunk, ids in ((1, old[1]), (2, new)):
        store = Catalog(tmp_path / "d")
        t = store.table("t")
        cf = store.db.cf[t.parts.placement.ssd.family]
        key = t.parts.placement.ssd.block_key(chunk, 1)
        value = bytearray(cf[key])
        value[len(value) // 2] ^= 0x01
        cf[key] = bytes(value)
        with pytest.raises(DataLoss, match=f"table 't': SSD tier, table id 1, chunk {chunk}, block 1: "
                                           f"checksum mismatch"):
            t.get(ids)
        store.close()


def rows_of(table, ids) -> list[dict]:
    return table.get(ids).data.to_pylist()


def test_blocks_reject_damage():
    batch = trajectories(2, tokens=16).to_batches()[0]
    data = codec.encode_block(batch).to_pybytes()
    crc = codec.block_checksum(data)
    assert codec.decode_block(data, batch.schema, "x", crc).equals(batch)
    assert codec.decode_block(data, batch.schema, "x", zlib.crc32(data), "crc32").equals(batch)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    for bad in (data[:-3], data[:5], b"nonsense", bytes(flipped)):
        with pytest.raises(DataLoss):
            codec.decode_block(bad, batch.schema, "x", crc)
        with pytest.raises(DataLoss):
            codec.decode_block(bad, batch.schema, "x", zlib.crc32(data), "crc32")
    for bad in (data[:-3], data[:5], b"nonsense"):  # the IPC framing, even without a checksum
        with pytest.raises(DataLoss):
            codec.decode_block(bad, batch.schema, "x")
    old = legacy_block(batch)
    assert codec.decode_block(old, batch.schema, "x").equals(batch)
    for bad in (old[:-3], old[:5], old[:8] + b"\x00" * (len(old) - 8)):
        with pytest.raises(DataLoss):
            codec.decode_block(bad, batch.schema, "x")


def test_a_due_snapshot_is_written_while_the_tables_calls_go_on(tmp_path, monkeypatch):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t"))
    t.insert(trajectories(8, tokens=8, id_prefix="a"))
    went_on, write = [], Journal._write

    def write_while_sampling(journal, fields, upto):  # another caller samples meanwhile
        done = threading.Event()
        threading.Thread(target=lambda: (t.sample(2), done.set()), daemon=True).start()
        went_on.append(done.wait(5))
        write(journal, fields, upto)

    monkeypatch.setattr(Journal, "_write", write_while_sampling)
    due = iter([True])
    monkeypatch.setattr(Journal, "wants_snapshot", lambda self: next(due, False))
    t.insert(trajectories(8, tokens=8, id_prefix="b"))  # this change takes the snapshot
    t.insert(trajectories(8, tokens=8, id_prefix="c"))
    expected = t.get(np.arange(1, 25)).data
    store.wait_for_snapshots()
    assert went_on == [True]
    store.close()

    store = Catalog(tmp_path / "d")
    assert store.table("t").get(np.arange(1, 25)).data.equals(expected)
    store.close()


class _Held(Executor):
    """A writer that runs what it was given when told to (``run``)."""

    def __init__(self) -> None:
        self.calls = []

    def submit(self, fn, /, *args, **kwargs):
        self.calls.append((fn, args, kwargs))

    def run(self) -> None:
        for fn, args, kwargs in self.calls:
            fn(*args, **kwargs)


def test_a_snapshot_written_late_never_replaces_a_later_one_nor_outlives_a_drop(tmp_path):
    db = Database(tmp_path / "d")
    writer = _Held()
    j = Journal(db, 1, writer)
    j.append("x", n=1)
    j.snapshot({"state": "after 1"})  # waits for the writer
    j.append("x", n=2)
    j.write_snapshot({"state": "after 2"})  # taken later, written first
    j.append("x", n=3)
    writer.run()
    snapshot, records = Journal(db, 1).load()
    assert snapshot["state"] == "after 2" and [f["n"] for _, f in records] == [3]

    j.snapshot({"state": "after 3"})
    j.drop()
    writer.run()
    snapshot, records = Journal(db, 1).load()
    assert snapshot is None and list(records) == []
    db.close()


def test_a_snapshot_taken_once_the_writer_is_shut_down_is_written_by_its_caller(tmp_path):
    db = Database(tmp_path / "d")
    writer = ThreadPoolExecutor(1)
    writer.shutdown()  # the catalog is closing
    j = Journal(db, 1, writer)
    j.append("x", n=1)
    j.snapshot({"state": "after 1"})
    snapshot, records = Journal(db, 1).load()
    assert snapshot["state"] == "after 1" and list(records) == []
    db.close()


def test_concurrent_fsync_callers_share_one_fsync(tmp_path):
    """Group commit: callers arriving while an fsync runs wait for the next one, which
    covers them all, instead of each running its own."""
    db = Database(tmp_path / "d")
    rdict, started, release, calls = db._db, threading.Event(), threading.Event(), []

    class SlowLog:  # the first fsync takes until ``release``: the others queue meanwhile
        def flush_wal(self, sync):
            calls.append(sync)
            if len(calls) == 1:
                started.set()
                release.wait(10)
            rdict.flush_wal(sync)

        def __getattr__(self, name):
            return getattr(rdict, name)

    db._db = SlowLog()
    threads = [threading.Thread(target=db.sync) for _ in range(8)]
    threads[0].start()
    assert started.wait(10)
    for th in threads[1:]:
        th.start()
    deadline = time.monotonic() + 10
    while db._sync_tickets < 8 and time.monotonic() < deadline:  # all seven are waiting
        time.sleep(0.01)
    release.set()
    for th in threads:
        th.join(10)
    assert not any(th.is_alive() for th in threads)
    assert calls == [True, True]  # the first caller's, then one for the seven that waited
    db._db = rdict
    db.close()


def test_samples_warm_a_restarted_tables_memory_cache_while_it_has_room(tmp_path):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t"))
    for i in range(4):
        t.insert(trajectories(16, tokens=256, id_prefix=f"w{i}"))
    store.close()
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert t.stats()["items_memory"] == 0
    t.sample(64)
    t.wait_for_background()
    assert t.stats()["items_memory"] == 64 and not t.parts.placement.pinned()
    store.close()


def test_the_data_dir_records_its_remote_tier_and_refuses_another_while_tables_use_it(tmp_path):
    def open_store(data_dir, uri: str, in_data_dir: bool = False, restored: bool = False) -> Catalog:
        return Catalog(data_dir, remote=lambda name: RemoteTier(uri, name), remote_uri=uri,
                     remote_in_data_dir=in_data_dir, remote_restored=restored)

    inside = (tmp_path / "a" / "remote").as_uri()
    store = open_store(tmp_path / "a", inside, in_data_dir=True)
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=1))
    t.insert(trajectories(10, id_prefix="x"))
    while t.demote():
        pass
    assert t.stats()["remote_chunks"] == 1 and t.stats()["ssd_chunks"] == 0
    store.close()
    elsewhere = (tmp_path / "elsewhere").as_uri()
    with pytest.raises(FailedPrecondition, match=f"keeps chunks of tables t on the remote tier {inside}, but the "
                                                 f"server was started with remote tier {elsewhere}"):
        open_store(tmp_path / "a", elsewhere)
    # The default remote tier lives in the data dir and moves with it.
    (tmp_path / "a").rename(tmp_path / "b")
    store = open_store(tmp_path / "b", (tmp_path / "b" / "remote").as_uri(), in_data_dir=True)
    assert store.table("t").get([1]).data.column("traj_id").to_pylist() == ["x-0"]
    store.close()
    # A checkpoint restore copies the remote datasets into the restored server's own tier.
    shutil.copytree(tmp_path / "b" / "remote", tmp_path / "own")
    own = (tmp_path / "own").as_uri()
    open_store(tmp_path / "b", own, restored=True).close()
    store = open_store(tmp_path / "b", own)
    assert store.table("t").get([1]).data.column("traj_id").to_pylist() == ["x-0"]
    store.drop_table("t")
    store.close()
    open_store(tmp_path / "b", elsewhere).close()  # no table keeps chunks there any more


def test_rocksdb_memtables_stay_within_their_budget(tmp_path):
    store = Catalog(tmp_path / "d", memtable_bytes=16 << 20, cache_bytes=1 << 20)
    t = store.create_table(TableSpec("t", memory_bytes=1))
    for i in range(12):  # ~29 MB of rows: flushed to files on the way
        t.insert(trajectories(64, tokens=4096, id_prefix=f"m{i}"))
    assert store.db.unflushed_bytes() <= 16 << 20
    assert t.get(np.arange(1, 12 * 64 + 1, dtype=np.uint64)).data.num_rows == 12 * 64
    store.close()
