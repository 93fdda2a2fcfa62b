"""Large chunks in files of their own (tiers/files.py): exact rows after a restart and a
checkpoint's restore; orphans of a crash between a file and its meta key removed at the
next start, and nothing else; evictions and DropTable removing their files; a
missing, truncated or damaged file is DATA_LOSS naming the chunk; a full disk leaves
nothing behind; ``fsync`` syncs a file before its meta key is written; an evicted
chunk's file written over by a later chunk (recycled), never one a checkpoint holds."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expstore import checkpoint, codec
from expstore.catalog import Catalog
from expstore.checkpoint import Checkpointer
from expstore.codec import SerializedBlocks
from expstore.errors import DataLoss, ResourceExhausted
from expstore.spec import SamplerSpec, TableSpec
from expstore.synthetic import trajectories
from expstore.tiers import files as chunk_files
from expstore.tiers.remote import SealedObjects
from expstore.tiers.rocks import BLOCKS_DIR, FILE_BYTES, Database
from expstore.tiers.files import SPARE

pytestmark = pytest.mark.timeout(120)

def large(prefix: str, rows: int = 32, seed: int = 0):
    """Rows of 36 KiB: 32 of them (~1.2 MB) make a chunk over FILE_BYTES."""
    data = trajectories(rows, tokens=4096, id_prefix=prefix, seed=seed)
    assert data.get_total_buffer_size() >= FILE_BYTES
    return data


def table_dir(store: Catalog, table) -> os.PathLike:
    return store.db.blocks / str(table.parts.placement.ssd.table_id)


def names_in(directory) -> set[str]:
    return set(os.listdir(directory)) if os.path.isdir(directory) else set()


def rows_of(table, ids) -> list[dict]:
    return table.get(ids).data.select(["traj_id", "tokens", "logprobs", "loss_mask", "reward"]).to_pylist()


def expected_rows(data) -> list[dict]:
    return data.select(["traj_id", "tokens", "logprobs", "loss_mask", "reward"]).to_pylist()


@pytest.mark.parametrize("encoder", ["native", "python"])
def test_large_chunks_go_to_files_small_ones_to_rocksdb_and_both_read_back_exactly_after_a_restart(
        tmp_path, monkeypatch, encoder):
    if encoder == "python":
        monkeypatch.setattr(codec, "native", None)  # where the native encoder is not built
    elif codec.native is None:
        pytest.skip("the native encoder is not built (no C++ compiler)")
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", memory_bytes=1))  # every read goes to the SSD tier
    big, small = large("big"), trajectories(8, tokens=64, id_prefix="small")
    big_ids, small_ids = t.insert(big).item_ids, t.insert(small).item_ids
    ssd = t.parts.placement.ssd
    assert ssd.file_of(0) is not None and ssd.file_of(1) is None
    assert names_in(table_dir(store, t)) == {"0.blocks"}
    layout = ssd.layout(0)
    assert layout.positions[-1] == layout.stored == os.path.getsize(ssd.file_of(0))
    store.close()

    store = Catalog(tmp_path / "d")
    t = store.table("t")
    pick = np.random.default_rng(1).permutation(32)[:11]
    assert rows_of(t, big_ids[pick]) == [expected_rows(big)[i] for i in pick.tolist()]
    assert rows_of(t, small_ids) == expected_rows(small)
    store.close()


def test_a_crash_between_a_file_and_its_meta_key_leaves_an_orphan_the_next_start_removes(tmp_path):
    """A file written (whole or partial) whose meta key never was: the next start deletes
    it, ids go on past it, and a file this tier did not write stays."""
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t"))
    ids = t.insert(large("a")).item_ids
    directory = table_dir(store, t)
    store.close()
    files = chunk_files.ChunkFiles(directory, threading.Lock())
    files.write(7, SerializedBlocks([b"x" * 100]), sync=False)  # the crash: chunk 7's file, no meta key
    (directory / "9.blocks.partial").write_bytes(b"half")  # killed mid-write
    (directory / "operator-notes.txt").write_text("mine")
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    assert names_in(directory) == {"0.blocks", "operator-notes.txt"}
    assert rows_of(t, ids) == expected_rows(large("a"))
    new = t.insert(large("b", seed=1))
    assert new.num_inserted == 32 and t.parts.placement.ssd.file_of(10) is not None  # past the orphans' ids
    store.close()


def test_evicted_and_dropped_chunks_take_their_files_with_them(tmp_path):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", max_size=64, sampler=SamplerSpec("fifo")))
    for i in range(4):  # 128 rows into 64: the oldest two chunks are evicted
        t.insert(large(f"e{i}", seed=i))
    directory = table_dir(store, t)
    assert names_in(directory) == {"2.blocks", "3.blocks"}
    t.insert(large("e4", seed=4))
    assert names_in(directory) == {"3.blocks", "4.blocks"}
    (directory / "operator-notes.txt").write_text("mine")
    store.drop_table("t")
    assert names_in(directory) == {"operator-notes.txt"}  # what the tier did not write stays
    (directory / "operator-notes.txt").unlink()
    other = store.create_table(TableSpec("u"))
    other.insert(large("u"))
    store.drop_table("u")
    assert not os.path.exists(table_dir(store, other))
    store.close()


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_a_missing_truncated_or_damaged_file_is_data_loss_naming_the_chunk_and_block(tmp_path, damage):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", memory_bytes=1))
    ids = t.insert(large("a")).item_ids
    path, layout = t.parts.placement.ssd.file_of(0), t.parts.placement.ssd.layout(0)
    store.close()
    last = len(layout.positions) - 2
    if damage == "missing":
        path.unlink()
        match, blocks = "chunk 0, block 0: its file .*0.blocks is missing", range(last + 1)
    elif damage == "truncated":
        os.truncate(path, layout.positions[last] + 10)
        match, blocks = f"chunk 0, block {last}: its file .*0.blocks ends before", [last]
    else:
        with open(path, "r+b") as f:
            f.seek(int(layout.positions[3]) + 100)
            byte = f.read(1)[0]
            f.seek(int(layout.positions[3]) + 100)
            f.write(bytes([byte ^ 1]))
        match, blocks = "chunk 0, block 3: checksum mismatch", [3]
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    with pytest.raises(DataLoss, match=f"table 't': SSD tier, table id 1, {match}") as e:
        t.get(ids)
    offsets = layout.offsets.tolist()
    assert e.value.damage == {0: [(offsets[b], offsets[b + 1]) for b in blocks]}
    store.close()


def test_a_full_disk_during_a_file_write_is_resource_exhausted_and_leaves_nothing(tmp_path, monkeypatch):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t"))
    writev = os.writev

    def full(fd, buffers):
        writev(fd, buffers[:1])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(codec, "native", None)  # Python writes the blocks (the native writer: test_block_encoding.py)
    monkeypatch.setattr(codec.os, "writev", full)
    with pytest.raises(ResourceExhausted, match="the disk is full"):
        t.insert(large("a"))
    monkeypatch.undo()
    assert len(t) == 0 and names_in(table_dir(store, t)) == set()
    assert t.insert(large("a")).num_inserted == 32
    store.close()
    store = Catalog(tmp_path / "d")
    assert len(store.table("t")) == 32
    store.close()


@pytest.mark.parametrize("durability", ["wal", "fsync"])
def test_fsync_syncs_a_file_and_its_directory_before_the_meta_key_and_wal_does_not(tmp_path, monkeypatch,
                                                                                    durability):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t"))
    events: list[str] = []
    fdatasync, write = os.fdatasync, Database.write
    monkeypatch.setattr(chunk_files.os, "fdatasync", lambda fd: (events.append("fdatasync"), fdatasync(fd))[1])
    monkeypatch.setattr(chunk_files, "_sync_directory", lambda d: events.append(f"sync {d.name}"))
    monkeypatch.setattr(Database, "write", lambda self, *a, **k: (events.append("meta"), write(self, *a, **k))[1])
    t.insert(large("a"), durability=durability)
    table_id = str(t.parts.placement.ssd.table_id)
    first = events[:events.index("meta") + 1]  # the table's directory is made (and its parent synced) first
    assert first == ([f"sync {BLOCKS_DIR}", "fdatasync", f"sync {table_id}", "meta"] if durability == "fsync"
                     else [f"sync {BLOCKS_DIR}", "meta"])
    store.close()


def test_a_checkpoint_holds_the_chunk_files_and_restores_them_after_the_live_ones_are_gone(tmp_path):
    remote = SealedObjects((tmp_path / "remote-a").as_uri())
    store = Catalog(tmp_path / "a")
    t = store.create_table(TableSpec("t", memory_bytes=1))
    data = [large(f"c{i}", seed=i) for i in range(2)]
    ids = [t.insert(d).item_ids for d in data]
    (table_dir(store, t) / "9.blocks.partial").write_bytes(b"half")  # a file still being written
    info = Checkpointer(store, remote).create("c1")
    taken = {p.name for p in (tmp_path / "remote-a").rglob("*.blocks*")}
    assert taken == {"0.blocks", "1.blocks"}  # whole files only: a partial one may still change
    store.drop_table("t")  # the live files go
    store.close()
    own = SealedObjects((tmp_path / "remote-b").as_uri())
    source, name = checkpoint.locate(info.uri, own)
    checkpoint.restore(source, name, tmp_path / "b", own)
    restored = Catalog(tmp_path / "b")
    t = restored.table("t")
    assert names_in(table_dir(restored, t)) == {"0.blocks", "1.blocks"}
    for d, i in zip(data, ids):
        assert rows_of(t, i) == expected_rows(d)
    restored.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blocks=st.lists(st.binary(max_size=300), max_size=12), most=st.integers(1, 400),
       picks=st.lists(st.integers(0, 11), max_size=16))
def test_files_hold_their_blocks_whatever_writev_takes_and_reads_return_exactly_the_spans_asked(
        tmp_path, monkeypatch, blocks, most, picks):
    """``writev`` may write fewer bytes than it was given (here at most ``most`` a call);
    a read of any spans, in any order, adjacent or not, returns exactly their bytes."""
    writev = os.writev

    def short(fd, buffers):
        data = b"".join(bytes(b) for b in buffers)[:most]
        return writev(fd, [data]) if data else 0

    monkeypatch.setattr(codec.os, "writev", short)
    files = chunk_files.ChunkFiles(tmp_path / f"t{len(os.listdir(tmp_path))}", threading.Lock())
    files.write(3, SerializedBlocks(blocks), sync=False)
    whole = b"".join(blocks)
    assert files.path(3).read_bytes() == whole
    bounds = np.cumsum([0, *map(len, blocks)]).tolist()
    spans = [(bounds[i], bounds[i + 1]) for i in picks if i < len(blocks)]
    assert [bytes(v) for v in files.read(3, spans)] == [whole[lo:hi] for lo, hi in spans]


def spares_in(store: Catalog) -> set[str]:
    return {n for n in names_in(store.db.blocks) if n.endswith(SPARE)}


def test_an_evicted_chunks_file_is_written_over_by_the_next_chunk_which_reads_back_exactly(tmp_path):
    """The file of a chunk whose last row is evicted is kept (renamed), and the next chunk
    written over it, smaller (the rest cut off) or larger; its rows read back exactly
    from the SSD tier, before and after a restart."""
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", max_size=128, sampler=SamplerSpec("fifo"), memory_bytes=1))
    directory = table_dir(store, t)
    # FIFO, 128 rows at most: inserting chunk 3 evicts chunk 0's last rows, 4 chunk 1's,
    # 5 chunk 2's; so 4 is written over 0's file (64 rows -> 32), 5 over 1's (64 -> 80)
    sizes = [64, 64, 40, 56, 32, 80]
    data = [large(f"r{i}", rows=n, seed=i) for i, n in enumerate(sizes)]
    inodes, ids = [], []
    for i, d in enumerate(data):
        ids.append(t.insert(d).item_ids)
        inodes.append(os.stat(directory / f"{i}.blocks").st_ino)
        assert os.path.getsize(directory / f"{i}.blocks") == t.parts.placement.ssd.layout(i).stored
    assert len(set(inodes[:4])) == 4 and (inodes[4], inodes[5]) == (inodes[0], inodes[1])
    assert names_in(directory) == {"3.blocks", "4.blocks", "5.blocks"} and len(spares_in(store)) == 1  # 2's
    for i in (4, 5):
        assert rows_of(t, ids[i]) == expected_rows(data[i])
    store.close()
    assert {n for n in names_in(tmp_path / "d" / "rocksdb" / BLOCKS_DIR) if n.endswith(SPARE)} == set()
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    for i in (4, 5):
        assert rows_of(t, ids[i]) == expected_rows(data[i])
    store.close()


def test_a_file_a_checkpoint_holds_is_never_written_over(tmp_path):
    """A chunk file linked into a checkpoint has two links: evicted, it is unlinked, not
    kept, so the checkpoint's copy keeps its bytes while later chunks are written."""
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", max_size=64, sampler=SamplerSpec("fifo"), memory_bytes=1))
    for i in range(2):
        t.insert(large(f"c{i}", seed=i))
    store.db.checkpoint(tmp_path / "cp")
    held = {p: p.read_bytes() for p in (tmp_path / "cp" / BLOCKS_DIR).rglob("*.blocks")}
    assert len(held) == 2
    for i in range(2, 6):  # the two checkpointed chunks are evicted, and more files written
        t.insert(large(f"c{i}", seed=i))
    assert {p: p.read_bytes() for p in held} == held
    store.close()


def test_spares_are_bounded_and_a_failed_write_over_one_leaves_nothing(tmp_path, monkeypatch):
    blocks_dir = tmp_path / "blocks"
    blocks_dir.mkdir()
    (blocks_dir / "3.spare").write_bytes(b"left by a crash")
    (blocks_dir / "notes.spare").write_text("mine")
    spares = chunk_files.Spares(blocks_dir)
    assert names_in(blocks_dir) == {"notes.spare"}
    files = chunk_files.ChunkFiles(blocks_dir / "1", threading.Lock(), spares)
    for c in range(5):
        files.write(c, SerializedBlocks([bytes([c]) * 1000]), sync=False)
    files.delete(range(5))
    assert names_in(files.directory) == set()
    assert len(names_in(blocks_dir) - {"notes.spare", "1"}) == 2  # two kept, three unlinked
    files.write(7, SerializedBlocks([b"short"]), sync=True)
    assert files.path(7).read_bytes() == b"short"

    def full(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(codec, "native", None)
    monkeypatch.setattr(codec.os, "writev", full)
    with pytest.raises(OSError):
        files.write(8, SerializedBlocks([b"x" * 10]), sync=False)
    assert names_in(files.directory) == {"7.blocks"}
    assert len(names_in(blocks_dir) - {"notes.spare", "1"}) == 0  # the spare taken went with the failed write


def test_a_chunk_is_written_over_the_spare_closest_to_it_in_length(tmp_path, monkeypatch):
    """Longer (its tail cut off) or shorter (grown by the write), whichever is closer; a
    file the chunk fills exactly is not truncated at all."""
    blocks_dir = tmp_path / "blocks"
    blocks_dir.mkdir()
    files = chunk_files.ChunkFiles(blocks_dir / "1", threading.Lock(), chunk_files.Spares(blocks_dir, limit=4))
    for c, size in enumerate([3000, 1000, 8000, 5000]):
        files.write(c, SerializedBlocks([bytes([c]) * size]), sync=False)
    inodes = [os.stat(files.path(c)).st_ino for c in range(4)]
    files.delete(range(4))
    cuts = []
    ftruncate = os.ftruncate
    monkeypatch.setattr(chunk_files.os, "ftruncate", lambda fd, n: (cuts.append(n), ftruncate(fd, n)))
    for c, size, spare in ((4, 1000, 1), (5, 4200, 3), (6, 3500, 0), (7, 9000, 2)):
        files.write(c, SerializedBlocks([bytes([c]) * size]), sync=False)
        assert os.stat(files.path(c)).st_ino == inodes[spare]
        assert files.path(c).read_bytes() == bytes([c]) * size
    assert cuts == [4200]


def test_spares_are_the_first_space_a_short_disk_gets_back(tmp_path, monkeypatch):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", max_size=64, sampler=SamplerSpec("fifo")))
    for i in range(3):
        t.insert(large(f"s{i}", seed=i))
    assert len(spares_in(store)) == 1
    monkeypatch.setattr(Database, "free_bytes", lambda self: 1 << 40 if not spares_in(store) else 0)
    store.db.check_free_space(1 << 20)  # room once the spare is gone
    assert spares_in(store) == set()
    monkeypatch.setattr(Database, "free_bytes", lambda self: 0)
    with pytest.raises(ResourceExhausted, match="is full"):
        store.db.check_free_space(1 << 20)
    store.close()
