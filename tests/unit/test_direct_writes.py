"""The SSD tier's flushes and compactions write with direct I/O where the data dir's
filesystem takes it, through the page cache where it does not (or when asked to), and
store the same rows either way."""

from __future__ import annotations

import errno
import os

import pyarrow as pa
import pytest

from expstore.errors import InvalidArgument
from expstore.synthetic import trajectories
from expstore.tiers import rocks
from expstore.tiers.rocks import Database, RocksTier, open_rocks_tier
from expstore_server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)


def rocksdb_option(path, name: str) -> str:
    """An option's value in the OPTIONS file RocksDB wrote last for the database at ``path``."""
    latest = max((path / "rocksdb").glob("OPTIONS-*"), key=lambda f: int(f.name.split("-")[1]))
    values = dict(line.strip().split("=", 1) for line in latest.read_text().splitlines() if "=" in line)
    return values[name]


def flushed_and_read_back(path, **kwargs) -> tuple[bool, pa.RecordBatch, pa.RecordBatch]:
    """Store a chunk, flush it to a blob file, reopen the database (with direct writes)
    and read it back: (whether RocksDB was told to write directly, the chunk, what was read)."""
    batch = trajectories(16, tokens=1024).to_batches()[0]
    tier = RocksTier(Database(path, **kwargs), 1, owns_db=True)
    told = rocksdb_option(path, "use_direct_io_for_flush_and_compaction") == "true"
    assert tier.db.direct_writes == told
    tier.put(0, batch)
    tier.db.flush()
    tier.close()
    assert list((path / "rocksdb").glob("*.blob")), "the flush wrote no blob file"
    tier = open_rocks_tier(path, "t", 1)
    try:
        return told, batch, tier.get([0])[0]
    finally:
        tier.close()


def test_flushes_write_directly_where_the_filesystem_takes_it(tmp_path):
    direct, batch, read = flushed_and_read_back(tmp_path / "d")
    assert direct
    assert rocksdb_option(tmp_path / "d", "use_direct_reads") == "false"  # reads keep the page cache
    assert read.equals(batch)


def test_a_filesystem_without_direct_io_gets_buffered_flushes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct_io(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(rocks.os, "open", no_direct_io)
    direct, batch, read = flushed_and_read_back(tmp_path / "d")
    assert not direct
    assert read.equals(batch)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["LOCK.expstore", "rocksdb"]  # no probe left


def test_direct_writes_can_be_turned_off(tmp_path):
    direct, batch, read = flushed_and_read_back(tmp_path / "d", direct_writes=False)
    assert not direct
    assert read.equals(batch)


def test_rocksdb_direct_writes_is_checked():
    assert ServerConfig().rocksdb_direct_writes is True
    with pytest.raises(InvalidArgument, match="rocksdb_direct_writes must be true or false, got 'no'"):
        ServerConfig(rocksdb_direct_writes="no")
