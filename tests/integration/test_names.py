"""Names that become paths, keys and dataset URIs, refused at the RPC: a checkpoint named
``..`` (once the whole data dir's cleanup target), trailing newlines, ``.``, and a table
name that collides with another table's archive dataset. Nothing is changed by a refused
call: the server keeps its tables, and they survive a restart."""

from __future__ import annotations

import grpc
import pytest

from expstore_client import Client

from ._util import pb, raw_stub, rpc_error, start_server, stored_traj_ids, trajectories

pytestmark = pytest.mark.timeout(120)

BAD_CHECKPOINTS = ["..", ".", "a\n", "../x", "x/y", "/abs", "-flag", ".hidden", "a" * 129]
BAD_TABLES = ["a\n", ".", "..", "x.archive", "1x", "x/y"]
BAD_GROUPS = ["g\n", ".", "..", "", "a/b", "-g", "a" * 129]


def test_bad_checkpoint_names_are_refused_and_the_data_dir_is_intact(tmp_path):
    server = start_server(tmp_path / "a", None)
    c = Client(server.address)
    c.create_table("t")
    c.insert("t", trajectories(20, tokens=16, id_prefix="x"))
    before = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if "rocksdb" not in p.parts)
    for name in BAD_CHECKPOINTS:
        err = rpc_error(lambda: c.checkpoint(name), grpc.StatusCode.INVALID_ARGUMENT)
        assert repr(name) in err.details(), err.details()
    c.insert("t", trajectories(5, tokens=16, id_prefix="y"))  # still stored, where it belongs
    after = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if "rocksdb" not in p.parts)
    assert after == before
    assert not (tmp_path / "a" / "remote" / "checkpoints").exists() or \
        not any((tmp_path / "a" / "remote" / "checkpoints").iterdir())
    server.stop()
    again = start_server(tmp_path / "a", None)
    ids = stored_traj_ids(Client(again.address), "t", "check")
    assert sorted(ids) == sorted([f"x-{i}" for i in range(20)] + [f"y-{i}" for i in range(5)])
    again.stop()


def test_bad_table_and_consumer_group_names_are_invalid_arguments(shared_server):
    channel, stub = raw_stub(shared_server.address)
    c = Client(shared_server.address)
    c.create_table("names_t")
    c.insert("names_t", trajectories(3, tokens=8, id_prefix="n"))
    for name in BAD_TABLES:
        err = rpc_error(lambda: stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name=name)), timeout=10),
                        grpc.StatusCode.INVALID_ARGUMENT)
        assert "table name" in err.details() and repr(name) in err.details(), err.details()
    assert "x.archive" in BAD_TABLES and "reserved" in rpc_error(
        lambda: stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="x.archive")), timeout=10)).details()
    for group in BAD_GROUPS:
        calls = [lambda: list(stub.Stream(pb.StreamRequest(table="names_t", group=group, batch_size=1), timeout=10)),
                 lambda: stub.Ack(pb.AckRequest(table="names_t", group=group, item_ids=[1]), timeout=10),
                 lambda: stub.CommitCut(pb.CommitCutRequest(table="names_t", group=group, step=1), timeout=10),
                 lambda: stub.Resume(pb.ResumeRequest(table="names_t", group=group, step=1), timeout=10)]
        for call in calls:
            err = rpc_error(call, grpc.StatusCode.INVALID_ARGUMENT)
            assert "consumer group name" in err.details() and "names_t" in err.details(), err.details()
    assert c.stats("names_t")["names_t"]["consumer_groups"] == 0
    assert [len(b) for b in c.stream("names_t", "ok.group-1", 8, idle_timeout=0.5)] == [3]
    channel.close()
