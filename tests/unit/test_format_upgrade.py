"""A data dir written by the previous storage format (zstd + CRC32 blocks in the shared
``chunks`` column family, before blob files and a column family per table) opens and
reads back exactly: written here by that version's own code, checked out of git at the
last commit that had it and run in a subprocess. A server from before chunk files refuses
a data dir this version opened."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from expstore.catalog import Catalog
from expstore.spec import TableSpec
from expstore.synthetic import trajectories
from expstore.tiers.rocks import Database, RocksTier

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
LEGACY_COMMIT = "6ce630946d08d07b623d22f7cd8ec4192fe58234"  # the last commit writing the previous format

# Run by the previous version's code: tables of small (SST) and large (blob-sized) rows,
# samples, priority updates, a stream and an ack; one table flushed to SST files, the
# rest only in the write-ahead log when the process dies without closing (as kill -9).
WRITER = textwrap.dedent("""
    import json, os, sys
    import pyarrow as pa
    from expstore.spec import SamplerSpec, TableSpec
    from expstore.store import Store
    from expstore.synthetic import trajectories

    data_dir, out = sys.argv[1], sys.argv[2]
    store = Store(data_dir, seed=1)
    p = store.create_table(TableSpec("p", sampler=SamplerSpec("prioritized"), memory_bytes=1))
    s = store.create_table(TableSpec("s", sampler=SamplerSpec("fifo"), memory_bytes=1))
    ids = []
    for i, tokens in enumerate((16, 4096, 300)):
        ids.extend(int(x) for x in p.insert(trajectories(12, tokens=tokens, seed=i, id_prefix=f"p{i}-"), durability="wal").item_ids)
    p.update_priorities(ids[:5], [2.0, 3.0, 4.0, 5.0, 6.0])
    p.sample(7)
    store.db.flush()  # p's chunks in SST and (with blob files off) SST files only
    s.insert(trajectories(10, tokens=4096, seed=7, id_prefix="s"), durability="wal")
    s.insert(trajectories(5, tokens=16, seed=8, id_prefix="t"), durability="wal")
    got = s.stream("g", 4)
    s.ack("g", got.item_ids[:2])
    tables = {}
    for name, t in (("p", p), ("s", s)):
        batches = list(t.scan())
        tables[name] = pa.Table.from_batches(batches).drop_columns(["tier"]).to_pylist()
    with open(out, "w") as f:
        json.dump({"tables": tables, "stats": {"p": p.stats()["items"], "s": s.stats()["items"]}}, f)
    os._exit(0)  # no close: what was not flushed is in the write-ahead log only
""")


def source_at(commit: str, dest: Path) -> Path:
    """The ``expstore`` package of ``commit``, extracted under ``dest``."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "expstore"],
                                 capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"the code of {commit} is not available from git here: {e}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def written_by_legacy_code(tmp_path: Path) -> tuple[Path, dict]:
    src = source_at(LEGACY_COMMIT, tmp_path / "legacy")
    data, out = tmp_path / "d", tmp_path / "expected.json"
    # the legacy package first on the path: nothing of this checkout's expstore is imported
    subprocess.run([sys.executable, "-c", WRITER, str(data), str(out)], check=True, cwd=src,
                   env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}, timeout=240)
    return data, json.loads(out.read_text())


def scanned(table, drop=("tier",)) -> list[dict]:
    return pa.Table.from_batches(list(table.scan())).drop_columns(list(drop)).to_pylist()


def test_a_data_dir_written_by_the_previous_format_opens_and_reads_back_exactly(tmp_path):
    data, expected = written_by_legacy_code(tmp_path)
    raw = Database(data)
    assert raw.get("chunks", [RocksTier(raw, 1).block_key(0, 0)])[0][:4] == b"EXK1"  # the previous format
    raw.close()

    store = Catalog(data)
    assert not store.unopened
    p, s = store.table("p"), store.table("s")
    assert scanned(p) == expected["tables"]["p"]  # payloads, ids, priorities, times_sampled
    assert scanned(s) == expected["tables"]["s"]
    assert (p.stats()["items"], s.stats()["items"]) == (expected["stats"]["p"], expected["stats"]["s"]) == (36, 15)
    assert [int(i) for i in s.stream("g", 20).item_ids] == list(range(5, 16))  # the group's position held
    new = p.insert(trajectories(8, tokens=4096, seed=9, id_prefix="n")).item_ids  # new format beside the old
    assert p.sample(44).data.num_rows == 44
    store.close()

    store = Catalog(data)  # both formats in one table, after a restart
    p = store.table("p")
    sampled = ("tier", "times_sampled")  # the 44 samples above counted
    assert scanned(p, sampled)[:36] == [{k: v for k, v in r.items() if k != "times_sampled"}
                                        for r in expected["tables"]["p"]]
    assert p.get(new).data.num_rows == 8
    store.drop_table("p")
    store.drop_table("s")
    assert list(store.db.cf["chunks"].keys()) == []  # the old chunks went with their tables
    store.close()


BEFORE_CHUNK_FILES = "0d14f315e753a1522d37c508082e3e236788334f"  # the last commit without chunk files


def test_a_server_from_before_chunk_files_refuses_a_data_dir_that_may_hold_them(tmp_path):
    """Its reader would misread their meta values: it must not open the data dir at all."""
    store = Catalog(tmp_path / "d")
    store.create_table(TableSpec("t")).insert(trajectories(32, tokens=4096, id_prefix="f"))
    store.close()
    src = source_at(BEFORE_CHUNK_FILES, tmp_path / "before")
    opened = subprocess.run([sys.executable, "-c", "import sys; from expstore.catalog import Catalog; "
                             "Catalog(sys.argv[1])", str(tmp_path / "d")],
                            cwd=src, env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}, capture_output=True,
                            text=True, timeout=120)
    assert opened.returncode != 0 and "chunk_files" in opened.stderr, opened.stderr[-2000:]
