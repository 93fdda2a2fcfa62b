"""The daemon's lifecycle: start-up line, health service, config tables, draining on
SIGTERM, and clean failures on bad configuration."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expstore_client import Client

from ._util import ipc_bytes, pb, raw_stub, rpc_error, trajectories


def test_port_zero_prints_the_chosen_port_first(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "expstore_server.main", "--port", "0",
                             "--data-dir", str(tmp_path / "d")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("expstore-server listening on 127.0.0.1:"), first
        port = int(first.rsplit(":", 1)[1])
        assert 0 < port < 65536
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with Client(f"127.0.0.1:{port}") as c:
            assert c.list_tables() == []
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        proc.stdout.close()
        proc.stderr.close()


def test_health_service_reports_serving(shared_server):
    channel = grpc.insecure_channel(shared_server.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "expstore.v1.ExperienceStore"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    rpc_error(lambda: health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5),
              grpc.StatusCode.NOT_FOUND)
    channel.close()


def test_tables_declared_in_config_exist_at_start(server_factory):
    s = server_factory("""
        [server]
        visibility_timeout_s = 5.0

        [[tables]]
        name = "rollouts"
        sampler = {type = "prioritized", alpha = 0.6, beta = 0.4}
        max_size = 1000
        max_staleness = 4

        [[tables]]
        name = "queue"
        sampler = {type = "fifo"}
        remover = "fifo"
        max_times_sampled = 1
        rate_limiter = {type = "queue", size = 100}
        columns = {difficulty = "float32", tags = "list<string>"}
    """)
    with Client(s.address) as c:
        assert [t.name for t in c.list_tables()] == ["queue", "rollouts"]
        info = c.describe("rollouts")
        assert info.config["sampler"]["type"] == "prioritized"
        assert info.config["sampler"]["alpha"] == pytest.approx(0.6)
        assert info.config["max_size"] == 1000 and info.config["max_staleness"] == 4
        q = c.describe("queue")
        assert q.config["rate_limiter"]["type"] == "queue" and q.config["rate_limiter"]["size"] == 100
        assert "difficulty" in q.schema.names and "tags" in q.schema.names
        rows = trajectories(2).to_pylist()
        rows[0]["difficulty"] = 0.25
        ids = c.insert("queue", rows).item_ids
        assert c.sample("queue", 2).ids.tolist() == ids.tolist()


def test_sigterm_drains(server_factory):
    s = server_factory()
    c = Client(s.address)
    c.create_table("waiting", rate_limiter={"type": "min_size", "min_size_to_sample": 10})
    c.create_table("landing")
    out = {}

    def blocked_sample():
        try:
            c.sample("waiting", 1, timeout=20)
            out["sample"] = "returned"
        except grpc.RpcError as e:
            out["sample"] = e
        out["sample_done"] = time.monotonic()

    def slow_insert():
        # An insert that is in flight when SIGTERM arrives: its second message comes later.
        def messages():
            yield pb.InsertRequest(table="landing", arrow_ipc=ipc_bytes(trajectories(2, id_prefix="a")))
            time.sleep(0.8)
            yield pb.InsertRequest(arrow_ipc=ipc_bytes(trajectories(2, id_prefix="b")))
        channel, stub = raw_stub(s.address)
        try:
            out["insert"] = stub.Insert(messages(), timeout=10)
        except grpc.RpcError as e:
            out["insert"] = e
        channel.close()

    threads = [threading.Thread(target=blocked_sample), threading.Thread(target=slow_insert)]
    for t in threads:
        t.start()
    time.sleep(0.4)
    signalled = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(15)
    rc = s.proc.wait(10)
    exited = time.monotonic()
    c.close()

    err = out["sample"]
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "draining" in err.details()
    assert out["sample_done"] - signalled < 1.5, "the blocked sample did not end promptly"
    ins = out["insert"]
    assert not isinstance(ins, grpc.RpcError), ins
    assert ins.num_inserted == 4 and len(ins.item_ids) == 4
    assert rc == 0
    assert exited - signalled < 5.0
    assert '"stopped"' in s.log
    assert "Traceback" not in s.log


def test_sigint_exits_zero(server_factory):
    s = server_factory()
    with Client(s.address) as c:
        c.create_table("t")
    assert s.stop(signal.SIGINT, timeout=10) == 0


def run_server(tmp_path, config: str | None, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "expstore_server.main", "--port", "0", *args]
    if "--data-dir" not in args:
        cmd += ["--data-dir", str(tmp_path / "data")]
    if config is not None:
        path = tmp_path / "bad.toml"
        path.write_text(config)
        cmd += ["--config", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the server started (or hung) with a bad config: {out!r} {err!r}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def assert_one_line_failure(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "listening" not in result.stdout


BAD_CONFIGS = {
    "unknown-section": ("[servr]\nport = 1\n", ["servr"]),
    "unknown-key": ("[server]\nbogus = 1\n", ["bogus"]),
    "not-toml": ("this is = not [toml\n", ["bad.toml"]),
    "bad-sampler": ('[[tables]]\nname = "t"\nsampler = {type = "nope"}\n', ["nope"]),
    "group-without-size": ('[[tables]]\nname = "t"\nsampler = {type = "group"}\n', ["group_size"]),
    "queue-without-size": ('[[tables]]\nname = "t"\nrate_limiter = {type = "queue"}\n', ["size"]),
    "bad-column-type": ('[[tables]]\nname = "t"\ncolumns = {x = "complex128"}\n', ["complex128"]),
    "table-twice": ('[[tables]]\nname = "t"\n[[tables]]\nname = "t"\n', ["twice"]),
    "bad-role": ('[auth]\ntokens = [{name = "a", token = "s3cret-zz", roles = ["root"]}]\n', ["roles"]),
    "token-env-unset": ('[auth]\ntokens = [{name = "a", token_env = "EXPSTORE_UNSET_VAR", roles = ["admin"]}]\n',
                        ["EXPSTORE_UNSET_VAR"]),
    "workers-zero": ("[server]\nworkers = 0\n", ["workers"]),
    "message-bytes": ("[server]\nmessage_bytes = 10\n", ["message_bytes"]),
    "tls-half": ('[tls]\ncert = "/tmp/x.pem"\n', ["tls"]),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_exits_with_one_line(tmp_path, name):
    config, fragments = BAD_CONFIGS[name]
    result = run_server(tmp_path, config)
    assert_one_line_failure(result, *fragments)
    assert "s3cret-zz" not in result.stderr


def test_bad_flag_exits_non_zero(tmp_path):
    result = run_server(tmp_path, None, "--port", "not-a-number")
    assert result.returncode != 0 and "Traceback" not in result.stderr


BROKEN_AT_START = {
    "log-level": ('[server]\nlog_level = "verbose"\n', (), "log_level"),
    "tls-files-missing": (None, ("--tls-cert", "/nonexistent/expstore.pem", "--tls-key",
                                 "/nonexistent/expstore.key"), "/nonexistent/expstore"),
    "unbindable-host": (None, ("--host", "256.1.1.1"), "256.1.1.1"),
    "data-dir-is-a-file": (None, ("--data-dir", "{tmp}/a-file"), "a-file"),
}


@pytest.mark.parametrize("name", list(BROKEN_AT_START))
def test_bad_setting_found_at_start_exits_with_one_line(tmp_path, name):
    config, args, fragment = BROKEN_AT_START[name]
    (tmp_path / "a-file").write_text("not a directory")
    result = run_server(tmp_path, config, *(a.format(tmp=tmp_path) for a in args))
    assert_one_line_failure(result, fragment)
