"""Remote-tier behaviour beyond the Tier protocol: layout, sealed publish, scans, S3 config,
sealed checkpoint objects, and Unavailable when the S3 endpoint is down."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
import s3server
from test_tiers import chunk, same

from expstore.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from expstore.tiers.remote import SealedObjects, RemoteTier, fsspec_filesystem, lance_storage_options


@pytest.fixture
def local(tmp_path) -> RemoteTier:
    t = RemoteTier(tmp_path.as_uri(), "t")
    yield t
    t.close()


def test_one_fragment_per_chunk_with_a_chunk_column(tmp_path, local):
    for c in (3, 5):
        local.put(c, chunk(4, seed=c))
    ds = lance.dataset(str(tmp_path / "tables" / "t.lance"))
    assert len(ds.get_fragments()) == 2
    assert [f.to_table(columns=["_chunk"])["_chunk"].to_pylist() for f in ds.get_fragments()] == [[3] * 4, [5] * 4]
    assert "_chunk" not in local.get([3])[3].schema.names
    assert 3 in local and 4 not in local


def test_delete_drops_fragments_and_their_files(tmp_path, local):
    local.RETAIN = timedelta(0)  # no snapshot readers to protect here
    for c in range(3):
        local.put(c, chunk(4, seed=c))
    data = tmp_path / "tables" / "t.lance" / "data"
    assert len(list(data.iterdir())) == 3
    local.delete([0, 2])
    ds = lance.dataset(str(tmp_path / "tables" / "t.lance"))
    assert [f.deletion_file() for f in ds.get_fragments()] == [None]  # dropped, not tombstoned
    assert len(list(data.iterdir())) == 1


def test_an_uncommitted_fragment_is_invisible(tmp_path, local):
    """A crash between writing a fragment's data file and committing the manifest."""
    local.put(0, chunk(3, seed=0))
    orphan = chunk(3, seed=1)
    orphan = orphan.append_column("_chunk", pa.array([1] * 3, pa.int64()))
    orphan = orphan.append_column("_nbytes", pa.array([1] * 3, pa.int64()))
    lance.fragment.LanceFragment.create(str(tmp_path / "tables" / "t.lance"), pa.Table.from_batches([orphan]))
    again = RemoteTier(tmp_path.as_uri(), "t")
    assert len(again) == 1
    with pytest.raises(NotFound):
        again.get([1])
    again.put(1, chunk(3, seed=1))
    assert same(again.get([1])[1], chunk(3, seed=1))
    again.close()


def test_put_of_a_held_chunk_is_a_no_op(local):
    """Chunk ids are never reused, so a second put is a retry whose first attempt landed:
    it only checks what is stored (and returns the same checksums)."""
    first = local.put(0, chunk(3, seed=0))
    assert np.array_equal(local.put(0, chunk(3, seed=0)), first)
    with pytest.raises(FailedPrecondition, match="chunk 0 is held with other rows"):
        local.put(0, chunk(5, seed=9))
    assert same(local.get([0])[0], chunk(3, seed=0))
    assert local.nbytes == chunk(3, seed=0).get_total_buffer_size()


def test_refuses_empty_chunks_and_other_schemas(local):
    with pytest.raises(InvalidArgument, match="empty"):
        local.put(0, chunk(2).slice(0, 0))
    local.put(0, chunk(2))
    with pytest.raises(InvalidArgument, match="schema"):
        local.put(1, chunk(2).drop_columns(["reward"]))


def test_scan_selects_columns_and_pushes_the_filter_down(local):
    assert local.scan().read_all().num_rows == 0
    for c in range(3):
        local.put(c, chunk(4, seed=c))
    everything = local.scan().read_all()
    assert everything.schema.names == chunk(1).schema.names and everything.num_rows == 12
    some = local.scan(["traj_id", "reward"], "reward > 0.5").read_all()
    assert some.schema.names == ["traj_id", "reward"]
    rows = [row for c in range(3) for row in chunk(4, seed=c).select(["traj_id", "reward"]).to_pylist()]
    assert sorted(some["traj_id"].to_pylist()) == sorted(r["traj_id"] for r in rows if r["reward"] > 0.5)
    tagged = local.scan(filter="_chunk = 1", with_chunk=True).read_all()
    assert tagged["_chunk"].to_pylist() == [1] * 4


def test_lance_storage_options_map_config_and_environment(monkeypatch):
    for var in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert lance_storage_options() == {}
    assert lance_storage_options("http://127.0.0.1:9000", "eu-west-1", "k", "s") == {
        "aws_endpoint": "http://127.0.0.1:9000", "aws_region": "eu-west-1", "aws_access_key_id": "k",
        "aws_secret_access_key": "s", "allow_http": "true"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.example")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ek")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "es")
    assert lance_storage_options(key="k") == {"aws_endpoint": "https://s3.example", "aws_region": "us-west-2",
                                              "aws_access_key_id": "k", "aws_secret_access_key": "es"}


def test_fsspec_filesystem_maps_the_same_config(s3_server, tmp_path):
    assert "file" in fsspec_filesystem(tmp_path.as_uri()).protocol
    fs = fsspec_filesystem("s3://x", **s3_server.config)
    assert fs.client_kwargs == {"endpoint_url": s3_server.endpoint, "region_name": s3server.REGION}
    bucket = s3_server.bucket("fs")
    fs.pipe_file(f"{bucket}/k", b"v")
    assert fs.cat_file(f"{bucket}/k") == b"v"


def _files(root: Path) -> dict[str, bytes]:
    (root / "sub").mkdir(parents=True)
    files = {"a.bin": b"\x00" * 1000, "sub/b.txt": b"hello", "sub/empty": b""}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    return files


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> SealedObjects:
    if request.param == "file":
        return SealedObjects((tmp_path / "remote").as_uri())
    s3 = request.getfixturevalue("s3_server")
    uri = f"s3://{s3.bucket('store')}/ckpt"
    return SealedObjects(uri, fs=fsspec_filesystem(uri, **s3.config))


def test_sealed_dir_round_trip(store, tmp_path):
    files = _files(tmp_path / "src")
    store.check()
    store.put_dir(tmp_path / "src", "step-1")
    store.put_file(tmp_path / "src" / "a.bin", "loose/a.bin")
    assert store.list_sealed() == ["step-1"]
    out = store.get_dir("step-1", tmp_path / "dst")
    assert {rel: (out / rel).read_bytes() for rel in files} == files
    with pytest.raises(AlreadyExists, match="sealed"):
        store.put_dir(tmp_path / "src", "step-1")


def test_unsealed_prefix_is_refused(store, tmp_path):
    _files(tmp_path / "src")
    store.put_file(tmp_path / "src" / "a.bin", "half/a.bin")  # an upload that crashed before its seal
    with pytest.raises(NotFound, match="not sealed"):
        store.get_dir("half", tmp_path / "dst")
    assert store.list_sealed() == []


def test_delete_prefix_unseals_then_deletes(store, tmp_path):
    _files(tmp_path / "src")
    store.put_dir(tmp_path / "src", "runs/1")
    store.put_dir(tmp_path / "src", "runs/2")
    assert store.list_sealed("runs") == ["runs/1", "runs/2"]
    store.delete_prefix("runs/1")
    store.delete_prefix("runs/1")
    assert store.list_sealed() == ["runs/2"]
    with pytest.raises(NotFound):
        store.get_dir("runs/1", tmp_path / "dst")


def test_a_file_of_another_size_than_its_seal_is_reported(tmp_path):
    store = SealedObjects((tmp_path / "remote").as_uri())
    _files(tmp_path / "src")
    store.put_dir(tmp_path / "src", "s")
    (tmp_path / "remote" / "s" / "a.bin").write_bytes(b"short")
    with pytest.raises(DataLoss, match="a.bin has 5 bytes, its seal says 1000"):
        store.get_dir("s", tmp_path / "dst")


@pytest.mark.parametrize("path", ["../../x", "sub/../../x", "/tmp/expstore-abs-seal", "sub//b.txt", ".", ""])
def test_a_seal_listing_a_path_outside_its_prefix_is_refused_before_anything_is_written(store, tmp_path, path):
    _files(tmp_path / "src")
    store.put_files(tmp_path / "src", "evil")
    store.put_bytes(json.dumps({"files": {"a.bin": 1000, path: 5}}).encode(), "evil/_SEALED")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(DataLoss, match="not a relative path inside its directory"):
        store.get_dir("evil", tmp_path / "dst" / "deep")
    assert sorted(tmp_path.rglob("*")) == before and not Path("/tmp/expstore-abs-seal").exists()
    with pytest.raises(InvalidArgument, match="not a relative path"):
        store.put_file(tmp_path / "src" / "a.bin", "a/../../b")


@pytest.mark.parametrize("seal", [b"not json", b"[]", b'{"files": ["a.bin"]}', b'{"files": {"a.bin": -1}}',
                                  b'{"files": {"a.bin": "1000"}}', b'{"files": {"_SEALED": 3}}'])
def test_a_seal_that_is_not_a_list_of_files_is_data_loss(tmp_path, seal):
    store = SealedObjects((tmp_path / "remote").as_uri())
    _files(tmp_path / "src")
    store.put_files(tmp_path / "src", "s")
    store.put_bytes(seal, "s/_SEALED")
    with pytest.raises(DataLoss, match="refusing to read the prefix"):
        store.get_dir("s", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_copy_is_server_side_or_a_link_and_sizes_lists_a_prefix(store, tmp_path):
    _files(tmp_path / "src")
    store.put_files(tmp_path / "src", "a")
    store.copy({"a/a.bin": "b/x/a.bin", "a/sub/b.txt": "b/b.txt"})
    assert store.sizes("b") == {"x/a.bin": 1000, "b.txt": 5} and store.sizes("nothing") == {}
    assert store.read("b/b.txt") == b"hello" and store.exists("b/x") and not store.exists("c")
    other = SealedObjects((tmp_path / "other").as_uri())
    store.copy({"a/sub/b.txt": "y/b.txt"}, into=other)
    assert (tmp_path / "other" / "y" / "b.txt").read_bytes() == b"hello"
    with pytest.raises(NotFound, match="does not exist"):
        store.copy({"a/missing": "b/missing"})


def test_a_version_copied_and_cloned_outlives_the_cleanup_of_its_source(tmp_path, local):
    local.RETAIN = timedelta(0)
    for c in range(3):
        local.put(c, chunk(4, seed=c))
    version = local.version
    store = SealedObjects(tmp_path.as_uri())
    local.hold()
    local.delete([0, 1])  # a commit: the cleanup it would run is held off
    assert len(list((tmp_path / "tables" / "t.lance" / "data").iterdir())) == 3
    store.copy({f"tables/t.lance/{rel}": f"copy/tables/t.lance/{rel}" for rel in local.version_files(version)})
    local.clone(version, f"{store.uri}/copy/tables/t.lance")
    local.release()
    local.delete([2])  # now the cleanup removes the dropped fragments' files
    assert not any((tmp_path / "tables" / "t.lance" / "data").iterdir())
    copy = RemoteTier(f"{store.uri}/copy", "t")
    assert sorted(copy.chunk_ids()) == [0, 1, 2]
    assert all(same(b, chunk(4, seed=c)) for c, b in copy.get([0, 1, 2]).items())
    copy.close()


def test_a_down_endpoint_is_unavailable_until_it_is_back():
    """Its own moto server, stopped mid-test and restarted on its port; few retries so each
    failure is quick."""
    s3 = s3server.start()
    uri = f"s3://{s3.bucket('down')}/p"
    options = {**s3.lance_options, "client_max_retries": "0", "client_retry_timeout": "1"}
    tier = RemoteTier(uri, "t", storage_options=options)
    tier.put(0, chunk(2))
    store = SealedObjects(uri, fs=fsspec_filesystem(uri, **s3.config, config_kwargs=s3.fsspec_options["config_kwargs"]))
    store.check()
    s3.stop()
    with pytest.raises(Unavailable, match=f"remote tier {uri}"):
        tier.get([0])
    assert not tier.ready and tier.error.startswith(f"remote tier {uri}")
    with pytest.raises(Unavailable, match="retried in the background"):  # reads now fail at once
        tier.get([0])
    with pytest.raises(Unavailable, match=f"remote tier {uri}"):
        tier.put(1, chunk(2))
    closed = RemoteTier(uri, "t", storage_options=options)  # opening is lazy: no I/O ...
    with pytest.raises(Unavailable, match=f"remote tier {uri}/tables/t.lance: probe"):  # ... until the first call
        closed.probe()
    with pytest.raises(Unavailable, match=f"remote tier {uri}"):
        len(closed)
    with pytest.raises(Unavailable, match=f"remote store {uri}: check"):
        store.check()
    with pytest.raises(Unavailable, match=f"remote tier {uri}/tables/t.lance: probe"):
        tier.probe()
    back = s3server.start(int(s3.endpoint.rsplit(":", 1)[1]))
    try:
        store.check()
        tier.probe()
        assert tier.ready and tier.error is None
        assert len(tier) == 1  # the failed put did not count
        tier.put(1, chunk(2, seed=1))  # the retry
        assert same(tier.get([1])[1], chunk(2, seed=1))
        closed.probe()
        assert (len(closed), closed.nbytes) == (2, tier.nbytes)
        closed.close()
    finally:
        back.stop()
        tier.close()
