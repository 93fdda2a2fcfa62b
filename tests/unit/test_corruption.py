"""Damage on disk and in the bucket: one flipped byte in a real RocksDB SST file or a real
Lance fragment is detected, named (table, chunk, block), contained (the other tables and
the healthy items serve on) and quarantined (later calls never touch it, across restarts);
no wrong byte is ever returned."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pytest
from damage import flip_in_file, flip_in_sst, flip_stored, flush, fragment_file, logprob_bytes

from expstore import query as q
from expstore import recovery
from expstore.errors import DataLoss, DeadlineExceeded
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.tiers.remote import RemoteTier
from expstore.tiers.rocks import MIN_BLOB_BYTES, table_prefix

pytestmark = pytest.mark.timeout(180)
META = 0xFFFFFFFF


def stored(store: Catalog, table: str, chunk: int, block: int) -> tuple[bytes, bytes]:
    """(key, value) of a chunk's block (or META) in the SSD tier, for ``flip_stored``."""
    ssd = store.table(table).parts.placement.ssd
    key = ssd.block_key(chunk, block)
    return key, store.db.get(ssd.family, [key])[0]


def rows(batch: pa.RecordBatch | pa.Table) -> list[dict]:
    return batch.to_pylist()


def test_a_flipped_byte_in_a_blob_file_is_data_loss_naming_table_chunk_block_then_quarantined(tmp_path):
    store = Catalog(tmp_path / "d")
    a = store.create_table(TableSpec("a", sampler=SamplerSpec("fifo"), memory_bytes=1))
    b = store.create_table(TableSpec("b", memory_bytes=1))
    ids = a.insert(trajectories(40, tokens=1024, id_prefix="a")).item_ids
    b_ids = b.insert(trajectories(10, tokens=64, id_prefix="b")).item_ids
    expected, b_expected = rows(a.get(ids).data), rows(b.get(b_ids).data)
    offsets = a.parts.placement.ssd.layout(0).offsets.tolist()
    assert len(offsets) > 4  # several blocks: one of them is damaged
    lo, hi = offsets[2], offsets[3]
    value = stored(store, "a", 0, 2)
    flush(store.db)
    store.close()
    flip_stored(tmp_path / "d", *value)

    store = Catalog(tmp_path / "d")
    a, b = store.table("a"), store.table("b")
    with pytest.raises(DataLoss, match=r"table 'a': SSD tier, table id 1, chunk 0, block 2: Corruption: Blob CRC "
                                       rf"mismatch.*; {hi - lo} items stored there are quarantined") as e:
        a.sample(40)  # fifo: every item, the damaged block's among them
    assert e.value.damage == {0: [(lo, hi)]}
    s = a.stats()
    assert (s["quarantined_items"], s["quarantined_chunks"], s["items"]) == (hi - lo, 1, 40 - (hi - lo))
    healthy = np.r_[ids[:lo], ids[hi:]]
    got = a.sample(len(healthy))  # the healthy items of the same chunk are served
    assert got.item_ids.tolist() == healthy.tolist()
    assert rows(got.data) == [expected[i] for i in (healthy - 1).tolist()]
    with pytest.raises(DataLoss, match=f"table 'a': item {ids[lo]} is quarantined: its chunk 0 on the ssd tier"):
        a.get(ids[lo:lo + 1])
    with pytest.raises(DeadlineExceeded):  # never sampled again
        a.sample(len(healthy) + 1, timeout=0)
    assert rows(b.get(b_ids).data) == b_expected  # the other table never noticed
    b.insert(trajectories(5, tokens=64, id_prefix="b2"))
    with a.lock:
        recovery.write_snapshot(a)  # the quarantine is in the snapshot too, not only in the journal
    store.close()

    store = Catalog(tmp_path / "d")  # quarantined for good: the snapshot says so
    a = store.table("a")
    assert store.restored["a"]["lost"] == 0
    s = a.stats()
    assert (s["quarantined_items"], s["items"]) == (hi - lo, len(healthy))
    assert rows(a.get(healthy).data) == [expected[i] for i in (healthy - 1).tolist()]
    with pytest.raises(DataLoss, match="is quarantined"):
        a.get(ids[hi - 1:hi])
    assert store.table("b").stats()["items"] == 15
    store.close()


def test_a_flipped_sst_block_holding_a_small_chunk_is_data_loss_naming_it_then_quarantined(tmp_path):
    """Blocks under MIN_BLOB_BYTES stay in SST files, checked by RocksDB's block checksums."""
    store = Catalog(tmp_path / "d")
    a = store.create_table(TableSpec("a", memory_bytes=1))
    small = a.insert(trajectories(3, tokens=16, id_prefix="s")).item_ids  # chunk 0: one block of ~2 KiB
    large = a.insert(trajectories(10, tokens=1024, id_prefix="l")).item_ids  # chunk 1: in a blob file
    expected = rows(a.get(large).data)
    key, value = stored(store, "a", 0, 0)
    assert len(value) < MIN_BLOB_BYTES <= len(stored(store, "a", 1, 0)[1])
    flush(store.db)
    store.close()
    flip_in_sst(tmp_path / "d", value)

    store = Catalog(tmp_path / "d")
    a = store.table("a")
    # (the RocksDB block may hold chunk 0's metadata too: then it is found damaged at start)
    with pytest.raises(DataLoss, match=r"table 'a': .*chunk 0.*Corruption: block checksum mismatch"):
        a.get(small)
    s = a.stats()
    assert (s["quarantined_items"], s["items"]) == (3, 10)
    with pytest.raises(DataLoss, match="is quarantined: its chunk 0 on the ssd tier"):
        a.get(small[:1])
    assert rows(a.get(large).data) == expected
    store.close()


def test_a_damaged_chunk_metadata_block_quarantines_its_items_at_start(tmp_path):
    store = Catalog(tmp_path / "d")
    a = store.create_table(TableSpec("a", memory_bytes=1))
    b = store.create_table(TableSpec("b", memory_bytes=1))
    a_ids = a.insert(trajectories(10, tokens=256, id_prefix="a")).item_ids
    first = b.insert(trajectories(6, tokens=8, id_prefix="x")).item_ids  # one block under MIN_BLOB_BYTES: in the SST
    second = b.insert(trajectories(11, tokens=256, id_prefix="y")).item_ids  # chunk 1: the last key
    a_rows, first_rows = rows(a.get(a_ids).data), rows(b.get(first).data)
    value = stored(store, "b", 1, META)
    flush(store.db)
    store.close()
    flip_stored(tmp_path / "d", *value)

    store = Catalog(tmp_path / "d")  # starts: the damage is one chunk's, not the server's
    a, b = store.table("a"), store.table("b")
    s = b.stats()
    assert (s["quarantined_items"], s["quarantined_chunks"], s["items"]) == (11, 1, 6)
    assert rows(b.get(first).data) == first_rows
    with pytest.raises(DataLoss, match=r"table 'b': item 7 is quarantined: its chunk 1 on the ssd tier is "
                                       r"damaged \(SSD tier, table id 2, chunk 1, metadata: Corruption"):
        b.get(second[:1])
    assert rows(a.get(a_ids).data) == a_rows
    store.close()

    store = Catalog(tmp_path / "d")
    assert store.table("b").stats()["quarantined_items"] == 11 and len(store.table("b")) == 6
    assert not store.unopened
    store.close()


@pytest.mark.parametrize("what", ["journal", "snapshot"])
def test_a_damaged_journal_or_snapshot_leaves_its_table_closed_and_the_others_serving(tmp_path, what):
    store = Catalog(tmp_path / "d")
    a = store.create_table(TableSpec("a"))
    b = store.create_table(TableSpec("b"))
    for i in range(6):  # a's journal spans several blocks before b's begins
        a.insert(trajectories(40, tokens=16, id_prefix=f"a{i}-"))
    b_ids = b.insert(trajectories(10, tokens=64, id_prefix="b")).item_ids
    if what == "snapshot":  # (b's too: a lookup of b's absent snapshot would land in a's block)
        for t in (a, b):
            with t.lock:
                recovery.write_snapshot(t)
    b_rows = rows(b.get(b_ids).data)
    if what == "journal":
        value = next(v for _, v in store.db.items("journal", table_prefix(1)))
    else:
        value = store.db.get("meta", [b"snapshot/" + table_prefix(1)])[0]
        assert len(value) > 8192  # a block of its own
    flush(store.db)
    store.close()
    flip_in_sst(tmp_path / "d", value)

    store = Catalog(tmp_path / "d")
    cf = "journal" if what == "journal" else "meta"
    for call in (lambda: store.table("a"), lambda: store.create_table(TableSpec("a"))):
        with pytest.raises(DataLoss, match=rf"table 'a' could not be restored at start: SSD tier \({cf}\)"
                                           r".*Corruption.*DropTable to delete it"):
            call()  # never restored with records missing
    assert list(store.unopened) == ["a"]
    b = store.table("b")
    assert rows(b.get(b_ids).data) == b_rows
    b.insert(trajectories(5, tokens=64, id_prefix="b2"))
    assert b.sample(15).data.num_rows == 15
    store.drop_table("a")  # deletes what is left of it
    assert "a" not in store.unopened and store.db.get("meta", [b"table/a"])[0] is None
    assert not list(store.db.items("journal", table_prefix(1)))
    if what == "journal":  # (the snapshot's block also holds the next table id: left alone here)
        a = store.create_table(TableSpec("a"))
        assert a.insert(trajectories(3, tokens=8, id_prefix="new")).num_inserted == 3
    store.close()


def test_damaged_table_records_leave_those_tables_closed_and_the_server_up(tmp_path):
    store = Catalog(tmp_path / "d")
    a = store.create_table(TableSpec("a"))
    store.create_table(TableSpec("b"))
    a.insert(trajectories(200, tokens=8, id_prefix="a"))
    with a.lock:
        recovery.write_snapshot(a)  # a large value between the next table id and the table records
    value = store.db.get("meta", [b"table/a"])[0]
    flush(store.db)
    store.close()
    flip_in_sst(tmp_path / "d", value)

    store = Catalog(tmp_path / "d")
    with pytest.raises(DataLoss, match="table 'a' could not be restored at start: table 'a': its record"):
        store.table("a")  # not silently gone
    assert set(store.unopened) == {"a", "b"}  # one RocksDB block held both records
    c = store.create_table(TableSpec("c"))
    assert c.insert(trajectories(3, tokens=8)).num_inserted == 3
    store.close()


def remote_store(tmp_path):
    uri = (tmp_path / "remote").as_uri()
    return uri, Catalog(tmp_path / "d", remote=lambda name: RemoteTier(uri, name))


def test_a_flipped_byte_in_a_remote_fragment_is_data_loss_never_wrong_rows(tmp_path):
    uri, store = remote_store(tmp_path)
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=1))
    u = store.create_table(TableSpec("u", tiers="remote", memory_bytes=1, ssd_bytes=1))
    chunks = [t.insert(trajectories(10, tokens=128, id_prefix=f"t{i}-", seed=i)).item_ids for i in range(3)]
    u_ids = u.insert(trajectories(10, tokens=128, id_prefix="u")).item_ids
    while t.demote() + u.demote():
        pass
    assert t.stats()["items_remote"] == 30 and u.stats()["items_remote"] == 10
    expected = [rows(t.get(ids).data) for ids in chunks]
    damaged_rows = t.get(chunks[1]).data
    store.close()
    flip_in_file(fragment_file(f"{uri}/tables/t.lance", 1), logprob_bytes(damaged_rows, 3))

    uri, store = remote_store(tmp_path)
    t, u = store.table("t"), store.table("u")
    every = np.concatenate(chunks)
    with pytest.raises(DataLoss, match=r"table 't': remote tier .*t\.lance: chunk 1 \(fragment \d+\) checksum "
                                       r"mismatch in column\(s\) logprobs; the stored fragment is corrupt"):
        t.get(every)
    assert t.stats()["quarantined_items"] == 10 and t.stats()["items"] == 20
    for i in (0, 2):
        assert rows(t.get(chunks[i]).data) == expected[i]
    for _ in range(5):  # samples never meet the damaged chunk again
        got = t.sample(20)
        assert not np.isin(got.item_ids, chunks[1]).any()
    assert u.get(u_ids).data.num_rows == 10
    store.close()

    uri, store = remote_store(tmp_path)
    t = store.table("t")
    assert t.stats()["quarantined_items"] == 10 and store.restored["t"]["lost"] == 0
    with pytest.raises(DataLoss, match="quarantined: its chunk 1 on the remote tier is damaged"):
        t.get(chunks[1][:1])
    assert rows(t.get(np.concatenate([chunks[0], chunks[2]])).data) == expected[0] + expected[2]
    store.close()


def test_a_remote_fragment_that_does_not_decode_quarantines_its_chunk_once_the_tier_is_reached(tmp_path):
    uri, store = remote_store(tmp_path)
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=1))
    chunks = [t.insert(trajectories(10, tokens=64, id_prefix=f"t{i}-", seed=i)).item_ids for i in range(2)]
    while t.demote():
        pass
    expected = rows(t.get(chunks[0]).data)
    store.close()
    path = fragment_file(f"{uri}/tables/t.lance", 1)
    data = bytearray(path.read_bytes())
    data[-40:-16] = bytes(24)  # the footer: where the column metadata is
    path.write_bytes(bytes(data))

    uri, store = remote_store(tmp_path)  # starts, the other chunk serving
    t = store.table("t")
    t.demote()  # the mover's first pass reaches the remote tier (start-up does not)
    s = t.stats()
    assert (s["quarantined_items"], s["items"]) == (10, 10)
    assert rows(t.get(chunks[0]).data) == expected
    with pytest.raises(DataLoss, match="chunk 1 on the remote tier is damaged .*has no readable fragment"):
        t.get(chunks[1][:1])
    store.close()


def test_queries_fail_with_data_loss_then_list_the_quarantined_items(tmp_path):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", memory_bytes=1))
    ids = t.insert(trajectories(30, tokens=1024, id_prefix="q")).item_ids
    value = stored(store, "t", 0, 1)
    lo, hi = t.parts.placement.ssd.layout(0).offsets[1:3].tolist()
    flush(store.db)
    store.close()
    flip_stored(tmp_path / "d", *value)
    store = Catalog(tmp_path / "d")

    def run(sql):
        return q.query(q.store_sources(store), sql).read_all()
    with pytest.raises(DataLoss, match="table 't': SSD tier, table id 1, chunk 0, block 1"):
        run("SELECT traj_id, tokens FROM t")  # DATA_LOSS: not a bad query
    got = run("SELECT item_id, tier, traj_id FROM t ORDER BY item_id")
    assert got.column("item_id").to_pylist() == ids.tolist()  # nothing silently gone
    tiers = got.column("tier").to_pylist()
    assert [i for i, x in zip(ids.tolist(), tiers) if x == "quarantined"] == ids[lo:hi].tolist()
    assert got.column("traj_id").to_pylist()[lo:hi] == [None] * (hi - lo)
    assert run("SELECT count(*) AS n FROM t WHERE tier = 'quarantined'").column("n")[0].as_py() == hi - lo
    store.close()


def test_a_damaged_ssd_block_stays_behind_while_the_mover_demotes_the_rest(tmp_path):
    uri, store = remote_store(tmp_path)
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=1))
    chunks = [t.insert(trajectories(12, tokens=1024, id_prefix=f"m{i}-", seed=i)).item_ids for i in range(3)]
    value = stored(store, "t", 1, 1)  # (block 0 would share its RocksDB block with chunk 0's metadata)
    lo, hi = t.parts.placement.ssd.layout(1).offsets[1:3].tolist()
    expected = rows(t.get(chunks[1]).data)
    flush(store.db)
    store.close()
    flip_stored(tmp_path / "d", *value)

    uri, store = remote_store(tmp_path)
    t = store.table("t")
    while t.demote():
        pass
    s = t.stats()
    assert s["demotions"] == 2 and s["ssd_chunks"] == 1 and s["demotion_failures"] == 0
    assert s["quarantined_items"] == hi - lo
    healthy = np.r_[chunks[1][:lo], chunks[1][hi:]]
    assert rows(t.get(healthy).data) == expected[:lo] + expected[hi:]
    assert t.get(np.concatenate([chunks[0], chunks[2]])).data.num_rows == 24
    store.close()


def test_archive_fragments_and_chunks_waiting_for_the_archive_are_verified(tmp_path):
    uri, store = remote_store(tmp_path)
    t = store.create_table(TableSpec("t", tiers="remote", archive=True, max_size=20, remover="fifo",
                                     memory_bytes=1, ssd_bytes=1 << 40))
    t.insert(trajectories(20, tokens=1024, id_prefix="old"))  # chunk 0
    waiting = stored(store, "t", 0, 1)
    lo, hi = t.parts.placement.ssd.layout(0).offsets[1:3].tolist()
    t.insert(trajectories(20, tokens=1024, id_prefix="new"))  # evicts chunk 0's items: it waits for the archive
    flush(store.db)
    store.close()
    flip_stored(tmp_path / "d", *waiting)

    uri, store = remote_store(tmp_path)
    t = store.table("t")
    while t.archive_pending():
        pass
    sql = "SELECT traj_id FROM t WHERE tier = 'archive' ORDER BY traj_id"
    archived = q.query(q.store_sources(store), sql).read_all()
    kept = [f"old-{i}" for i in range(20) if not lo <= i < hi]
    assert archived.column("traj_id").to_pylist() == sorted(kept)  # the healthy rows of the chunk
    assert t.stats()["quarantined_items"] == hi - lo and t.stats()["items"] == 20
    store.close()

    path = fragment_file(f"{uri}/tables/t.archive.lance", 0)
    archived_rows = RemoteTier(uri, "t.archive").get([0])[0]
    flip_in_file(path, logprob_bytes(archived_rows, 2))
    uri, store = remote_store(tmp_path)
    sql = "SELECT traj_id, logprobs FROM t WHERE tier = 'archive'"
    with pytest.raises(DataLoss, match=r"table 't': remote tier .*t\.archive\.lance: chunk 0 .*checksum mismatch in "
                                       r"column\(s\) logprobs"):
        q.query(q.store_sources(store), sql).read_all()
    assert q.query(q.store_sources(store), sql).read_all().num_rows == 0  # left out from now on
    assert store.table("t").stats()["quarantined_chunks"] == 2
    store.close()


@pytest.mark.slow
def test_no_flipped_byte_anywhere_in_a_fragment_is_returned_as_rows(tmp_path):
    """Sweep a flipped byte over a whole Lance fragment file (data pages, page table,
    footer), each time on a fresh copy of the server's data: every read either fails or
    returns exactly what was inserted."""
    uri, store = remote_store(tmp_path / "pristine")
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=1))
    ids = t.insert(trajectories(16, tokens=64, seed=5)).item_ids
    while t.demote():
        pass
    expected = rows(t.get(ids).data)
    store.close()
    original = fragment_file(f"{uri}/tables/t.lance", 0).read_bytes()
    outcomes = {"same": 0, "failed": 0}
    for at in range(0, len(original), max(1, len(original) // 40)):
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        shutil.copytree(tmp_path / "pristine", tmp_path / "run")
        uri, store = remote_store(tmp_path / "run")
        path = fragment_file(f"{uri}/tables/t.lance", 0)
        damaged = bytearray(original)
        damaged[at] ^= 0x5A
        path.write_bytes(bytes(damaged))
        try:
            got = rows(store.table("t").get(ids).data)
        except Exception:  # noqa: BLE001 - any refusal will do; wrong rows will not
            outcomes["failed"] += 1
            continue
        finally:
            store.close()
        assert got == expected, f"a flipped byte at {at} of {len(original)} came back as rows"
        outcomes["same"] += 1
    assert outcomes["failed"] > 25, outcomes
