"""Tier faults through a real server: started while S3 is down it serves its memory and SSD
tiers and catches up once S3 is back; started against another remote tier than the one
its data dir used it refuses, losing nothing; on a full disk, DropTable works and gives
the space back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
import s3server
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expstore_client import Client

from ._util import rpc_error, start_server, trajectories, wait_until

pytestmark = pytest.mark.timeout(300)


def s3_config(s3, bucket: str, extra: str = "") -> str:
    return f"""
    [server]
    demote_interval_s = 0.2

    [remote]
    uri = "s3://{bucket}/expstore"
    endpoint = "{s3.endpoint}"
    region = "{s3server.REGION}"
    access_key_id = "{s3server.KEY}"
    secret_access_key_env = "TEST_S3_SECRET"
    {extra}
    """


ENV = {"TEST_S3_SECRET": s3server.SECRET}


def remote_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service="expstore.remote")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def test_a_server_starts_with_s3_down_serves_memory_and_ssd_and_catches_up_when_s3_returns(tmp_path):
    s3 = s3server.start()
    port = int(s3.endpoint.rsplit(":", 1)[1])
    config = s3_config(s3, s3.bucket("down"))
    try:
        server = start_server(tmp_path / "data", config, env=ENV)
        c = Client(server.address)
        c.create_table("r", tiers="remote", ssd_bytes=200_000, memory_bytes=1 << 20, sampler="lifo")
        c.create_table("s", sampler="uniform")
        ids = [c.insert("r", trajectories(10, tokens=512, id_prefix=f"r{i}")).item_ids.tolist() for i in range(12)]
        c.insert("s", trajectories(20, tokens=64, id_prefix="s"))
        assert wait_until(lambda: c.stats("r")["r"]["remote_chunks"] >= 6, timeout=60), c.stats("r")
        remote_before = c.stats("r")["r"]["remote_chunks"]
        server.stop(signal.SIGTERM)
        s3.stop()

        server = start_server(tmp_path / "data", config, env=ENV)  # on main: refused, S3 unreachable
        c = Client(server.address)
        stats = c.stats("r")["r"]
        # known from the journal (the mover may have moved another chunk before the stop)
        assert stats["items"] == 120 and stats["remote_chunks"] >= remote_before
        newest = c.get("r", ids[-1])  # SSD items are served ...
        assert newest.column("traj_id").to_pylist() == [f"r11-{j}" for j in range(10)]
        assert sorted(c.sample("r", 10).ids.tolist()) == ids[-1]  # (lifo: the newest, on the SSD)
        assert len(c.sample("s", 5)) == 5
        err = rpc_error(lambda: c.get("r", ids[0]), grpc.StatusCode.UNAVAILABLE)  # ... remote-only ones not
        assert "remote tier" in err.details()
        assert wait_until(lambda: remote_health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
                          timeout=60)
        c.insert("r", trajectories(10, tokens=512, id_prefix="late"))  # inserts go on, into the SSD tier

        s3 = s3server.start(port)
        assert wait_until(lambda: remote_health(server.address) == health_pb2.HealthCheckResponse.SERVING,
                          timeout=120)
        assert wait_until(lambda: c.stats("r")["r"]["remote_chunks"] > remote_before, timeout=60)  # the mover resumed
        oldest = c.get("r", ids[0])
        assert oldest.column("traj_id").to_pylist() == [f"r0-{j}" for j in range(10)]
        assert c.stats("r")["r"]["items"] == 130
        server.stop(signal.SIGTERM)
    finally:
        s3.stop()


def start_fails(data_dir, *args: str) -> str:
    """Run the server expecting it to refuse to start; returns its stderr."""
    cmd = [sys.executable, "-m", "expstore_server.main", "--port", "0", "--data-dir", str(data_dir), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # "listening ..." if it started; "" once it exits
    if first:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert not first and proc.returncode != 0, f"the server started: {first}"
    return err


def test_another_remote_uri_is_refused_at_start_and_loses_nothing(tmp_path):
    first, other = (f"--remote-uri={(tmp_path / name).as_uri()}" for name in ("remote", "elsewhere"))
    server = start_server(tmp_path / "data", None, first)
    c = Client(server.address)
    c.create_table("r", tiers="remote", ssd_bytes=100_000, memory_bytes=1 << 20)
    c.create_table("s")
    for i in range(15):
        c.insert("r", trajectories(10, tokens=256, id_prefix=f"r{i}"), durability="wal")
    c.insert("s", trajectories(5, id_prefix="s"))
    assert wait_until(lambda: c.stats("r")["r"]["remote_chunks"] >= 5, timeout=60), c.stats("r")
    server.stop(signal.SIGTERM)

    err = start_fails(tmp_path / "data", other)  # on main: started with 25 of 150 items
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "keeps chunks of tables r on the remote tier" in lines[0] and (tmp_path / "remote").as_uri() in lines[0]
    assert (tmp_path / "elsewhere").as_uri() in lines[0]

    server = start_server(tmp_path / "data", None, first)
    c = Client(server.address)
    assert c.stats("r")["r"]["items"] == 150 and c.stats("s")["s"]["items"] == 5
    rows = c.get("r", list(range(1, 151)))
    assert rows.column("traj_id").to_pylist() == [f"r{i}-{j}" for i in range(15) for j in range(10)]
    c.drop_table("r")
    server.stop(signal.SIGTERM)
    # With no table left on the remote tier, the data dir takes another one.
    server = start_server(tmp_path / "data", None, other)
    assert Client(server.address).stats("s")["s"]["items"] == 5
    server.stop(signal.SIGTERM)


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("disk_mib, min_free", [(48, 0), (160, 16 << 20)])
def test_on_a_full_disk_drop_table_succeeds_and_gives_the_space_back(small_disk, disk_mib, min_free):
    """A real (tmpfs) disk filled by inserts: RESOURCE_EXHAUSTED before RocksDB meets ENOSPC,
    then DropTable works and gives the space back, as the error advises."""
    disk = small_disk(disk_mib)
    server = start_server(disk / "data", f"[server]\nmin_free_disk_bytes = {min_free}\n")
    c = Client(server.address)
    c.create_table("keep", sampler="uniform")
    c.insert("keep", trajectories(8, tokens=64, id_prefix="k"))
    c.create_table("big")
    at_start = free_bytes(disk)
    full = None
    for i in range(10_000):
        try:
            c.insert("big", trajectories(64, tokens=1024, id_prefix=f"b{i}"))
        except grpc.RpcError as e:
            full = e
            break
    assert full is not None and full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full
    assert len(c.sample("keep", 4)) == 4  # reads go on
    c.drop_table("big")  # on main: RESOURCE_EXHAUSTED (min_free 0), or the space stays taken
    # RocksDB deletes the obsolete files on its background threads: soon, on a busy machine not at once
    assert wait_until(lambda: free_bytes(disk) >= at_start - (2 << 20), timeout=60), free_bytes(disk)
    assert "is full" in full.details() and "drop tables" in full.details()  # the advice that worked
    c.insert("keep", trajectories(16, tokens=1024, id_prefix="after"))
    assert c.stats("keep")["keep"]["items"] == 24
    server.stop(signal.SIGTERM)
    server = start_server(disk / "data")
    c = Client(server.address)
    assert [t.name for t in c.list_tables()] == ["keep"] and c.stats("keep")["keep"]["items"] == 24
    server.stop(signal.SIGTERM)
