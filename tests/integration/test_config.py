"""Server settings (TOML [server], [tls], [auth]) observed over the wire."""

from __future__ import annotations

import signal
import threading
import time

import grpc

from expstore_client import Client

from ._util import audit_lines, insert_requests, raw_stub, rpc_error, self_signed, trajectories, wait_until


def test_default_visibility_timeout(server_factory):
    s = server_factory("[server]\nvisibility_timeout_s = 0.3\n")
    with Client(s.address) as c:
        c.create_table("t")
        ids = c.insert("t", trajectories(3)).item_ids.tolist()
        stream = c.stream("t", "g", 10, poll_timeout=2)  # no visibility_timeout: the server's
        assert next(stream).ids.tolist() == ids
        t0 = time.monotonic()
        assert next(stream).ids.tolist() == ids  # redelivered
        assert time.monotonic() - t0 < 1.5


def test_audit_log_path_and_flags_override_config(server_factory, tmp_path):
    audit = tmp_path / "elsewhere" / "audit.jsonl"
    s = server_factory(f'[server]\naudit_log = "{audit}"\ndata_dir = "{tmp_path}/ignored"\nport = 1\n')
    with Client(s.address) as c:  # --port 0 and --data-dir (flags) won over the file
        c.create_table("t")
        c.insert("t", trajectories(1))
    assert wait_until(lambda: audit.exists() and audit.read_text().count("\n") >= 2)
    lines = [line for line in audit.read_text().splitlines() if line]
    assert len(lines) == 2 and '"CreateTable"' in lines[0] and '"Insert"' in lines[1]
    assert not (tmp_path / "ignored").exists()
    assert audit_lines(s.data_dir) == []


def test_max_message_bytes_refuses_larger_messages(server_factory):
    s = server_factory("[server]\nmax_message_bytes = 1048576\nmessage_bytes = 65536\n")
    with Client(s.address, message_bytes=4 << 20) as big, Client(s.address, message_bytes=256 << 10) as ok:
        big.create_table("t")
        data = trajectories(64, tokens=4096)  # ~2.3 MB: one message from `big`
        rpc_error(lambda: big.insert("t", data), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert big.describe("t").num_items == 0
        assert ok.insert("t", data).num_inserted == 64  # split into messages under the limit
        assert len(ok.sample("t", 64)) == 64  # and the server splits its answer


def test_tls_from_toml(server_factory, tmp_path):
    cert, key = self_signed(tmp_path)
    s = server_factory(f'[tls]\ncert = "{cert}"\nkey = "{key}"\n')
    with Client(s.address, tls=cert) as c:
        c.create_table("t")
        assert c.insert("t", trajectories(2)).num_inserted == 2


def test_one_worker_serves_many_blocked_calls(server_factory):
    """Blocked calls wait on the event loop, not on engine threads: with workers = 1,
    twenty samples blocked on the rate limiter do not stop an insert from landing."""
    s = server_factory("[server]\nworkers = 1\n")
    c = Client(s.address)
    c.create_table("t", rate_limiter={"type": "min_size", "min_size_to_sample": 5})
    results = []

    def sample():
        try:
            results.append(len(c.sample("t", 2, timeout=10)))
        except grpc.RpcError as e:
            results.append(e.code())

    threads = [threading.Thread(target=sample) for _ in range(20)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert c.insert("t", trajectories(5), timeout=5).num_inserted == 5
    for t in threads:
        t.join(10)
    assert results == [2] * 20
    assert time.monotonic() - t0 < 3.0
    c.close()


def test_grace_period_bounds_shutdown(server_factory):
    s = server_factory("[server]\ngrace_s = 0.5\n")
    with Client(s.address) as c:
        c.create_table("t")
    out = {}

    def endless_insert():
        def messages():
            yield from insert_requests("t", [trajectories(1)])
            time.sleep(4)  # the call does not finish within the grace period
        channel, stub = raw_stub(s.address)
        try:
            out["result"] = stub.Insert(messages(), timeout=15)
        except grpc.RpcError as e:
            out["result"] = e.code()
        channel.close()

    t = threading.Thread(target=endless_insert, daemon=True)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0
    assert time.monotonic() - t0 < 3.0
    t.join(10)
    assert out["result"] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), out


def test_insert_timeout_zero_does_not_wait(server_factory):
    """InsertRequest.timeout_s = 0: do not wait for the rate limiter (expstore_proto)."""
    s = server_factory()
    with Client(s.address) as c:
        c.create_table("t", rate_limiter={"type": "sample_to_insert_ratio", "samples_per_insert": 1.0,
                                          "min_size_to_sample": 1, "error_buffer": 1.0})
        c.insert("t", trajectories(2))  # the limiter is now full
        channel, stub = raw_stub(s.address)
        t0 = time.monotonic()
        rpc_error(lambda: stub.Insert(iter(insert_requests("t", [trajectories(1, id_prefix="z")], timeout_s=0.0)),
                                      timeout=10), grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - t0 < 1.0
        channel.close()
        assert c.describe("t").num_items == 2
