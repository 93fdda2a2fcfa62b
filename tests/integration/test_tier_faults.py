"""Tier faults through a real server: started while S3 is down it serves its memory and SSD
tiers and catches up once S3 is back; started against another remote tier than the one
its data dir used it refuses, losing nothing."""

from __future__ import annotations

import signal

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
        assert stats["items"] == 120 and stats["remote_chunks"] == remote_before  # known from the journal
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
