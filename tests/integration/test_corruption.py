"""Damage under a real server: a flipped byte in an SST file on disk gives DATA_LOSS naming
the table, chunk and block (never INTERNAL, never a server that will not start), the
damaged items are quarantined, and every other table keeps serving."""

from __future__ import annotations

import signal

import grpc
import pytest
from damage import flip_in_sst, flip_stored

from expstore.tiers.rocks import Database, table_prefix
from expstore_client import Client

from ._util import rpc_error, start_server, trajectories

pytestmark = pytest.mark.timeout(180)


def settled(server):
    """Stop the server, start and stop it once more: the write-ahead log is now in SST
    files (RocksDB flushes what it recovers), where a disk would damage it."""
    server.stop(signal.SIGTERM)
    start_server(server.data_dir).stop(signal.SIGTERM)


def stored(data_dir, cf: str, key: bytes) -> bytes:
    db = Database(data_dir)
    try:
        return db.get(cf, [key])[0]
    finally:
        db.close()


def test_a_damaged_sst_block_is_data_loss_naming_it_and_the_server_serves_on(tmp_path):
    server = start_server(tmp_path / "data")
    c = Client(server.address)
    c.create_table("a", sampler="fifo", memory_bytes=1)
    c.create_table("b", memory_bytes=1)
    ids = c.insert("a", trajectories(40, tokens=1024, id_prefix="a")).item_ids
    c.insert("b", trajectories(10, tokens=64, id_prefix="b"))
    expected = c.get("a", ids).data.to_pylist()
    settled(server)
    # chunk 0, block 2 of table a (id 1): rows [14, 21) at 7 rows a block
    key = table_prefix(1) + (0).to_bytes(8, "big") + (2).to_bytes(4, "big")
    flip_stored(tmp_path / "data", key, stored(tmp_path / "data", "chunks.1", key))  # a blob file's record

    server = start_server(tmp_path / "data")
    c = Client(server.address)
    err = rpc_error(lambda: c.sample("a", 40), grpc.StatusCode.DATA_LOSS)
    assert "table 'a': SSD tier, table id 1, chunk 0, block 2: Corruption: Blob CRC mismatch" in err.details()
    s = c.stats("a")["a"]
    lost = int(s["quarantined_items"])
    assert lost > 0 and s["items"] == 40 - lost and s["quarantined_chunks"] == 1
    batch = c.sample("a", 40 - lost)  # the healthy items, never a wrong byte
    assert batch.data.to_pylist() == [expected[i - 1] for i in batch.ids.tolist()]
    quarantined = sorted(set(ids.tolist()) - set(batch.ids.tolist()))
    err = rpc_error(lambda: c.get("a", quarantined[:1]), grpc.StatusCode.DATA_LOSS)
    assert f"item {quarantined[0]} is quarantined" in err.details()
    assert c.sample("b", 10).data.num_rows == 10
    got = c.query_table("SELECT item_id FROM a WHERE tier = 'quarantined' ORDER BY item_id")
    assert got.column("item_id").to_pylist() == quarantined
    server.stop()


def test_damaged_chunk_metadata_or_journal_at_start_never_takes_the_server_down(tmp_path):
    server = start_server(tmp_path / "data")
    c = Client(server.address)
    c.create_table("a", memory_bytes=1)
    c.create_table("b", memory_bytes=1)
    c.create_table("c", memory_bytes=1)
    for i in range(6):  # a's journal spans several RocksDB blocks
        c.insert("a", trajectories(40, tokens=16, id_prefix=f"a{i}-"))
    c.insert("b", trajectories(10, tokens=64, id_prefix="b"))
    first = c.insert("c", trajectories(6, tokens=8, id_prefix="x")).item_ids  # one small block: its own SST block
    last = c.insert("c", trajectories(11, tokens=256, id_prefix="y")).item_ids  # the last chunk key
    settled(server)
    data = tmp_path / "data"
    db = Database(data)
    journal = next(v for _, v in db.items("journal", table_prefix(1)))
    meta = db.get("chunks.3", [table_prefix(3) + (1).to_bytes(8, "big") + b"\xff" * 4])[0]
    db.close()
    flip_in_sst(data, journal)
    flip_in_sst(data, meta)

    server = start_server(data)  # starts: each damage is one table's or one chunk's
    c = Client(server.address)
    err = rpc_error(lambda: c.describe("a"), grpc.StatusCode.DATA_LOSS)
    assert "table 'a' could not be restored at start: SSD tier (journal)" in err.details()
    rpc_error(lambda: c.sample("a", 1), grpc.StatusCode.DATA_LOSS)
    stats = c.stats()
    assert stats["a"] == {"unopened": 1.0}
    assert stats["c"]["quarantined_items"] == 11 and stats["c"]["items"] == 6
    assert c.get("c", first).data.num_rows == 6
    rpc_error(lambda: c.get("c", last[:1]), grpc.StatusCode.DATA_LOSS)
    assert c.sample("b", 10).data.num_rows == 10
    assert "could not be restored" in server.log
    c.drop_table("a")
    c.create_table("a")
    assert c.insert("a", trajectories(3, tokens=8, id_prefix="new")).num_inserted == 3
    server.stop()
