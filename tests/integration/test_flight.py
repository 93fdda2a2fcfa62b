"""Arrow Flight for bulk data (docs/rpc.md, "Arrow Flight"): the documented example runs as
written; roles, tokens, TLS and the audit log hold on it; errors carry the statuses of
the gRPC service; calls that would wait with no Flight waiting place left go over gRPC."""

from __future__ import annotations

import ipaddress
import re
import signal
import threading
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from expstore_proto.v1 import expstore_pb2 as pb
from expstore_client import AsyncClient, Client

from ._util import (audit_lines, num_items, raw_stub, self_signed, start_server, trajectories, wait_until,
                    with_loss_mask)

pytestmark = pytest.mark.timeout(300)
RPC_MD = Path(__file__).resolve().parents[2] / "docs" / "rpc.md"
TOKENS = {"producer": "prod-Secret-f1", "trainer": "train-Secret-f2", "reader": "read-Secret-f3",
          "admin": "admin-Secret-f4"}
AUTH = "[auth]\ntokens = [\n" + "".join(f'  {{name = "{r}", token = "{t}", roles = ["{r}"]}},\n'
                                         for r, t in TOKENS.items()) + "]\n"


class _InfoClient:
    """``client.get_server_info()`` of the documented example: GetServerInfo over gRPC."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.channel, self.stub = raw_stub(address)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    def get_server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10, metadata=self.metadata)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("flight") / "data", AUTH)
    yield s
    s.stop()


def flight_of(address: str, token: str | None = None) -> flight.FlightClient:
    port = _InfoClient(address, token).get_server_info().flight_port
    assert port > 0
    return flight.connect(f"grpc://127.0.0.1:{port}")


def options(role: str | None) -> flight.FlightCallOptions:
    headers = [(b"authorization", f"Bearer {TOKENS[role]}".encode())] if role else []
    return flight.FlightCallOptions(headers=headers, timeout=30)


def test_the_documented_flight_example_runs_as_written(auth_server, capsys):
    with Client(auth_server.address, TOKENS["admin"]) as admin:
        admin.create_table("rollouts", sampler="fifo")
    code = re.search(r"## Arrow Flight.*?```python\n(.*?)```", RPC_MD.read_text(), re.S).group(1)
    # One token with both roles the example needs: the admin's.
    exec(compile(code, "docs/rpc.md", "exec"), {"client": _InfoClient(auth_server.address, TOKENS["admin"]),
                                                 "token": TOKENS["admin"].encode()})
    inserted, sampled, weights = capsys.readouterr().out.strip().split(" ", 2)
    assert (inserted, sampled) == ("4", "2") and weights == "[1.0, 1.0]"
    with Client(auth_server.address, TOKENS["admin"], flight=False) as admin:
        assert admin.stats("rollouts")["rollouts"]["items"] == 4
        admin.drop_table("rollouts")


def test_flight_checks_tokens_and_roles_and_audits_like_grpc(auth_server):
    with Client(auth_server.address, TOKENS["admin"]) as admin:
        admin.create_table("guarded")
    fc = flight_of(auth_server.address, TOKENS["reader"])
    rows = trajectories(3, id_prefix="g")
    command = pb.InsertRequest(table="guarded", timeout_s=5).SerializeToString()

    def put(role):
        writer, results = fc.do_put(flight.FlightDescriptor.for_command(command), rows.schema, options(role))
        try:
            writer.write_table(rows)
            writer.done_writing()
            return pb.InsertResponse.FromString(results.read().to_pybytes())
        finally:
            writer.close()

    with pytest.raises(flight.FlightUnauthenticatedError, match="missing bearer token"):
        put(None)
    with pytest.raises(flight.FlightUnauthorizedError, match="needs role 'producer'"):
        put("reader")
    assert put("producer").num_inserted == 3
    ticket = pb.FlightTicket(sample=pb.SampleRequest(table="guarded", batch_size=1, timeout_s=5))
    with pytest.raises(flight.FlightUnauthorizedError, match="needs role 'trainer'"):
        fc.do_get(flight.Ticket(ticket.SerializeToString()), options("producer")).read_all()
    assert fc.do_get(flight.Ticket(ticket.SerializeToString()), options("trainer")).read_all().num_rows == 1
    assert wait_until(lambda: len([line for line in audit_lines(auth_server.data_dir)
                                   if line["table"] == "guarded" and line["method"] == "Insert"]) == 3)
    lines = [line for line in audit_lines(auth_server.data_dir) if line["table"] == "guarded"
             and line["method"] == "Insert"]
    assert [(line["who"], line["outcome"]) for line in lines] == \
        [("anonymous", "UNAUTHENTICATED"), ("reader", "PERMISSION_DENIED"), ("producer", "OK")]
    assert lines[-1]["detail"] == "rows=3 inserted=3 duplicates=0"


@pytest.mark.parametrize("call", ["unknown table", "bad rows", "rate limiter", "bad ticket"])
def test_flight_errors_carry_the_grpc_status_and_message(shared_server, table_name, call):
    """The same failure over gRPC and over Flight: the same status code and message in
    the client's grpc.RpcError; a raw Flight client finds both in the error's extra_info."""
    with Client(shared_server.address, flight=False) as setup:
        setup.create_table(table_name, rate_limiter={"type": "min_size", "min_size_to_sample": 10})
    big = pa.table({"nope": pa.array([b"x" * 4096] * 512)})  # > flight_min_bytes: sent over Flight
    attempts = {"unknown table": lambda c: c.sample("no_such_table", 1, timeout=1),
                "bad rows": lambda c: c.insert(table_name, big),
                "rate limiter": lambda c: c.sample(table_name, 1, timeout=0.2),
                "bad ticket": None}
    if call == "bad ticket":
        fc = flight_of(shared_server.address)
        with pytest.raises(flight.FlightServerError) as err:
            fc.do_get(flight.Ticket(b"\xff\xff not a ticket")).read_all()
        code, _, message = err.value.extra_info.decode().partition("\n")
        assert code == "INVALID_ARGUMENT" and "not a valid FlightTicket" in message
        return
    errors = {}
    for use_flight in (False, True):
        with Client(shared_server.address, flight=use_flight) as c:
            with pytest.raises(grpc.RpcError) as err:
                attempts[call](c)
            errors[use_flight] = (err.value.code(), err.value.details())
    assert errors[True] == errors[False], errors


def test_flight_over_tls(server_factory, tmp_path):
    cert, key = self_signed(tmp_path)
    server = server_factory(f'[tls]\ncert = "{cert}"\nkey = "{key}"\n')
    with Client(server.address, tls=cert) as c:
        c.create_table("tls_t")
        rows = trajectories(64, tokens=4096)  # ~9 MB: over Flight
        assert c.insert("tls_t", rows).num_inserted == 64
        assert len(c.sample("tls_t", 8)) == 8
        assert c.flight_location.startswith("grpc+tls://")


def test_a_call_that_must_wait_with_no_flight_place_left_goes_over_grpc(server_factory):
    """flight_waiters = 1: the first sample that must wait holds the place; the second
    is told RETRY_GRPC and waits over gRPC; an insert releases both."""
    server = server_factory("[server]\nflight_waiters = 1\n")
    with Client(server.address, flight=False) as setup:
        setup.create_table("w", rate_limiter={"type": "min_size", "min_size_to_sample": 4})
    fc = flight_of(server.address)
    ticket = flight.Ticket(pb.FlightTicket(sample=pb.SampleRequest(table="w", batch_size=2, timeout_s=20))
                           .SerializeToString())
    results: dict[str, object] = {}
    holder = threading.Thread(target=lambda: results.update(raw=fc.do_get(ticket).read_all().num_rows))
    holder.start()
    assert wait_until(lambda: setup_stats(server.address)["sample_waits"] >= 1)
    with pytest.raises(flight.FlightUnavailableError) as err:  # no place left: repeat over gRPC
        fc.do_get(ticket).read_all()
    assert err.value.extra_info.startswith(b"RETRY_GRPC\n")
    client = Client(server.address)  # over Flight; sent on over gRPC
    waiting = threading.Thread(target=lambda: results.update(client=len(client.sample("w", 2, timeout=20))))
    waiting.start()
    assert wait_until(lambda: setup_stats(server.address)["sample_queue"] == 2)
    with Client(server.address) as producer:
        producer.insert("w", trajectories(8))
    holder.join(30)
    waiting.join(30)
    assert results == {"raw": 2, "client": 2}
    client.close()


def setup_stats(address: str) -> dict:
    with Client(address, flight=False) as c:
        return c.stats("w")["w"]


def test_a_server_without_flight_is_served_over_grpc(server_factory):
    server = server_factory(None, "--no-flight")
    assert _InfoClient(server.address).get_server_info().flight_port == 0
    with Client(server.address) as c:
        c.create_table("plain")
        assert c.insert("plain", trajectories(64, tokens=4096)).num_inserted == 64
        assert len(c.get("plain", [1, 2])) == 2 and c.flight_location is None


def test_async_client_uses_flight_for_bulk_data(shared_server, table_name):
    import asyncio

    async def main():
        async with AsyncClient(shared_server.address) as c:
            await c.create_table(table_name)
            try:
                assert (await c.insert(table_name, trajectories(64, tokens=4096))).num_inserted == 64
                batch = await c.sample(table_name, 16)
                assert len(batch) == 16 and c.flight_location.startswith("grpc+tcp://")
            finally:
                await c.drop_table(table_name)

    asyncio.run(main())


def test_a_bad_row_over_flight_names_table_row_and_column_and_stores_nothing(shared_server, table_name):
    with Client(shared_server.address, flight=False) as setup:
        setup.create_table(table_name)
        setup.insert(table_name, trajectories(3, id_prefix="ok"))
    bad = with_loss_mask(trajectories(6, id_prefix="bad"), row=4, token=10, value=2)
    fc = flight_of(shared_server.address)
    command = pb.InsertRequest(table=table_name, timeout_s=5).SerializeToString()
    writer, results = fc.do_put(flight.FlightDescriptor.for_command(command), bad.schema, options(None))
    with pytest.raises(flight.FlightServerError) as raw:  # the status comes with the close
        writer.write_table(bad)
        writer.done_writing()
        results.read()
        writer.close()
    code, _, message = raw.value.extra_info.decode().partition("\n")
    assert code == "INVALID_ARGUMENT", raw.value
    assert repr(table_name) in message and "row 4" in message and "'loss_mask'" in message, message
    with Client(shared_server.address, flight_min_bytes=0) as c:  # every insert over Flight
        with pytest.raises(grpc.RpcError) as err:
            c.insert(table_name, bad)
        assert c.flight_location is not None
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == message
        assert num_items(c, table_name) == 3
        c.drop_table(table_name)


@pytest.mark.parametrize("durability", ["wal", "fsync"])
def test_a_durable_insert_over_flight_survives_kill_9(tmp_path, durability):
    """Acknowledged over Flight on the default (durable) table, then the server is killed
    with SIGKILL: after a restart every row is there, once."""
    server = start_server(tmp_path / "data")
    try:
        with Client(server.address, flight_min_bytes=0) as c:
            c.create_table("t", sampler="fifo")
            rows = trajectories(40, tokens=512, id_prefix="f")
            assert c.insert("t", rows, durability=durability).num_inserted == 40
            assert c.flight_location is not None
        server.stop(signal.SIGKILL)
        server = start_server(server.data_dir)
        with Client(server.address) as c:
            assert num_items(c, "t") == 40
            again = c.insert("t", rows)
            assert again.num_duplicates == 40
            stored = c.get("t", again.item_ids)
            assert sorted(stored.data.column("traj_id").to_pylist()) == sorted(rows.column("traj_id").to_pylist())
    finally:
        server.stop(signal.SIGKILL)


def _listening(port: int) -> set[str]:
    """The local addresses of this machine's TCP sockets listening on ``port``, from
    /proc/net/tcp and tcp6 (an IPv4-mapped IPv6 address as its IPv4 address)."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hexaddress, _, hexport = local.partition(":")
            if state != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(bytes.fromhex(hexaddress[i:i + 8])[::-1] for i in range(0, len(hexaddress), 8))
            address = ipaddress.ip_address(raw)
            found.add(str(getattr(address, "ipv4_mapped", None) or address))
    return found


def test_the_flight_service_listens_on_the_servers_host_only(shared_server):
    """host = 127.0.0.1 (the default): the Flight port is bound to loopback alone, as
    the gRPC port is, never to every interface."""
    port = _InfoClient(shared_server.address).get_server_info().flight_port
    grpc_port = int(shared_server.address.rsplit(":", 1)[1])
    assert _listening(grpc_port) == {"127.0.0.1"}
    assert _listening(port) == {"127.0.0.1"}
