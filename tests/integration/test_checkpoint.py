"""Checkpoints through a real server: taken while inserts go on, restored into a fresh
data dir; on a local remote tier and on S3 (a moto server), configured in TOML."""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta

import grpc
import lance
import pytest
import s3server
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expstore_client import Client

from ._util import rpc_error, start_server, stored_traj_ids, trajectories, wait_until

pytestmark = pytest.mark.timeout(180)


def test_checkpoint_does_not_block_inserts_and_restores_into_a_fresh_data_dir(tmp_path):
    remote = f"--remote-uri={(tmp_path / 'remote').as_uri()}"
    server = start_server(tmp_path / "a", None, remote)
    c = Client(server.address)
    c.create_table("t", sampler="uniform")
    c.insert("t", trajectories(300, tokens=512, id_prefix="before"))
    stop, during = threading.Event(), []

    def produce():
        i = 0
        while not stop.is_set():
            c.insert("t", trajectories(4, tokens=64, id_prefix=f"during{i}"))
            during.append(i)
            i += 1

    writer = threading.Thread(target=produce)
    writer.start()
    info = c.checkpoint("ckpt-1")
    stop.set()
    writer.join()  # an insert that failed would have ended the writer early, with an error
    assert info["name"] == "ckpt-1" and info["uri"].endswith("/checkpoints/ckpt-1") and info["num_bytes"] > 0
    assert len(during) >= 2, "inserts did not go on while the checkpoint was taken"
    err = rpc_error(lambda: c.checkpoint("ckpt-1"), grpc.StatusCode.ALREADY_EXISTS)
    assert "ckpt-1" in err.details()
    server.stop()

    # A restored server gets a remote tier of its own (here b's default, file://<b>/remote)
    # and reads the checkpoint by its URI.
    restored = start_server(tmp_path / "b", None, "--restore-checkpoint", info["uri"])
    ids = stored_traj_ids(Client(restored.address), "t", "check")
    assert {f"before-{i}" for i in range(300)} <= set(ids) and len(ids) == len(set(ids))
    restored.stop()
    # Restoring needs an empty data dir, a sealed checkpoint, and another remote tier than
    # the server's it was taken from: nothing is written when one is missing.
    with pytest.raises(RuntimeError, match="already holds a database"):
        start_server(tmp_path / "b", None, "--restore-checkpoint", info["uri"])
    with pytest.raises(RuntimeError, match="is not sealed"):
        start_server(tmp_path / "c", None, remote, "--restore-checkpoint", "nope")
    with pytest.raises(RuntimeError, match="needs a remote tier of its own"):
        start_server(tmp_path / "d", None, remote, "--restore-checkpoint", "ckpt-1")
    assert not (tmp_path / "d" / "rocksdb").exists()


def test_a_server_on_s3_checkpoints_there_and_reports_its_remote_tier_healthy(tmp_path):
    s3 = s3server.start()
    bucket = s3.bucket("ckpt")
    config = f"""
    [remote]
    uri = "s3://{bucket}/expstore"
    endpoint = "{s3.endpoint}"
    region = "us-east-1"
    access_key_id = "{s3server.KEY}"
    secret_access_key_env = "TEST_S3_SECRET"

    [[tables]]
    name = "t"
    tiers = "remote"
    ssd_bytes = 200000
    """
    env = {"TEST_S3_SECRET": s3server.SECRET}
    try:
        server = start_server(tmp_path / "a", config, env=env)
        c = Client(server.address)
        c.insert("t", trajectories(200, tokens=512, id_prefix="x"))
        assert wait_until(lambda: c.stats("t")["t"]["remote_chunks"] > 0, timeout=30), c.stats("t")
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(service="expstore.remote"), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        info = c.checkpoint("s3-ckpt")
        assert info["uri"] == f"s3://{bucket}/expstore/checkpoints/s3-ckpt"
        server.stop(signal.SIGTERM)
        # Its own remote tier: the same bucket, another prefix (server-side copies).
        own = config.replace(f"s3://{bucket}/expstore", f"s3://{bucket}/restored")
        restored = start_server(tmp_path / "b", own, "--restore-checkpoint", info["uri"], env=env)
        rc = Client(restored.address)
        assert sorted(stored_traj_ids(rc, "t", "check")) == sorted(f"x-{i}" for i in range(200))
        restored.stop()
    finally:
        s3.stop()
    assert "TEST_S3_SECRET" not in os.environ


def test_a_checkpoint_keeps_its_remote_chunks_after_the_live_server_frees_and_cleans_them(tmp_path):
    config = """
    [[tables]]
    name = "t"
    tiers = "remote"
    ssd_bytes = 200000
    """
    server = start_server(tmp_path / "a", config)
    c = Client(server.address)
    c.insert("t", trajectories(200, tokens=512, id_prefix="x"))
    assert wait_until(lambda: c.stats("t")["t"]["remote_chunks"] > 0, timeout=30), c.stats("t")
    info = c.checkpoint("demoted")
    # The live server frees every chunk, and Lance removes their files at once.
    c.drop_table("t")
    dataset = tmp_path / "a" / "remote" / "tables" / "t.lance"
    assert wait_until(lambda: not lance.dataset(str(dataset)).get_fragments(), timeout=30)
    lance.dataset(str(dataset)).cleanup_old_versions(older_than=timedelta(0), delete_unverified=True)
    assert not any((dataset / "data").iterdir())
    server.stop()

    restored = start_server(tmp_path / "b", config, "--restore-checkpoint", info["uri"])
    rc = Client(restored.address)
    assert rc.stats("t")["t"]["remote_chunks"] > 0
    assert sorted(stored_traj_ids(rc, "t", "check")) == sorted(f"x-{i}" for i in range(200))
    restored.stop()
