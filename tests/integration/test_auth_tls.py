"""Bearer tokens with roles, the audit log, and TLS (docs/architecture.md#wire)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest

from expstore_client import AsyncClient, Client

from ._util import audit_lines, insert_requests, pb, raw_stub, rpc_error, self_signed, trajectories, wait_until

SECRETS = {
    "rollout-1": ("prod-Secret-7f3a9c", ["producer"]),
    "learner": ("trainer-Secret-91be22", ["trainer"]),
    "dashboard": ("reader-Secret-0c44d1", ["reader"]),
    "ops": ("admin-Secret-5e6f70", ["admin"]),
    "both": ("multi-Secret-a1b2c3", ["producer", "reader"]),
}
ENV_SECRET = "env-Secret-d00d5eed"  # token "ci" comes from the environment
ROLE_OF_METHOD = {
    "CreateTable": "admin", "DropTable": "admin",
    "ListTables": "reader", "DescribeTable": "any", "Get": "reader", "Stats": "reader",
    "Insert": "producer", "InsertUnary": "producer",
    "Sample": "trainer", "Stream": "trainer", "Ack": "trainer", "Nack": "trainer", "UpdatePriorities": "trainer",
    "SetPolicyVersion": "trainer", "Reserve": "producer", "Release": "producer",
}
TABLE = "secured"
PACED = "secured_paced"


def auth_config() -> str:
    entries = [f'{{name = "{n}", token = "{s}", roles = {r!r}}}'.replace("'", '"')
               for n, (s, r) in SECRETS.items()]
    entries.append('{name = "ci", token_env = "EXPSTORE_TEST_TOKEN", roles = ["admin"]}')
    return "[auth]\ntokens = [\n  " + ",\n  ".join(entries) + ",\n]\n"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    from ._util import start_server

    s = start_server(tmp_path_factory.mktemp("auth") / "data", auth_config(),
                     env={"EXPSTORE_TEST_TOKEN": ENV_SECRET})
    admin = Client(s.address, SECRETS["ops"][0])
    admin.create_table(TABLE)
    admin.create_table(PACED, max_staleness=0, pacing={"rollouts_per_version": 1_000_000})
    admin.reserve(PACED, 1, timeout=0)  # reservation 1, which Release calls give back
    admin.insert(TABLE, trajectories(4, id_prefix="seed"))
    # Deliver item 1 to group "g" so that acks of it are valid.
    next(admin.stream(TABLE, "g", 1, poll_timeout=1))
    admin.close()
    yield s
    s.stop()


def md(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def calls(stub, who: str, metadata):
    """One valid call per RPC; each succeeds when the role allows it."""
    def create():
        return stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name=f"made_by_{who}"), if_not_exists=True),
                                metadata=metadata, timeout=5)

    def drop():
        # The table to drop is made by the admin first, so only the role decides.
        admin_md = md(SECRETS["ops"][0])
        stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name=f"drop_{who}"), if_not_exists=True),
                         metadata=admin_md, timeout=5)
        return stub.DropTable(pb.DropTableRequest(table=f"drop_{who}"), metadata=metadata, timeout=5)

    return {
        "CreateTable": create,
        "DropTable": drop,
        "ListTables": lambda: stub.ListTables(pb.ListTablesRequest(), metadata=metadata, timeout=5),
        "DescribeTable": lambda: stub.DescribeTable(pb.DescribeTableRequest(table=TABLE), metadata=metadata,
                                                    timeout=5),
        "Get": lambda: list(stub.Get(pb.GetRequest(table=TABLE, item_ids=[1]), metadata=metadata, timeout=5)),
        "Stats": lambda: stub.Stats(pb.StatsRequest(table=TABLE), metadata=metadata, timeout=5),
        "Insert": lambda: stub.Insert(iter(insert_requests(TABLE, [trajectories(1, id_prefix=f"by-{who}")])),
                                      metadata=metadata, timeout=5),
        "InsertUnary": lambda: stub.InsertUnary(insert_requests(TABLE, [trajectories(1, id_prefix=f"one-{who}")])[0],
                                                metadata=metadata, timeout=5),
        "Sample": lambda: list(stub.Sample(pb.SampleRequest(table=TABLE, batch_size=1, timeout_s=1),
                                           metadata=metadata, timeout=5)),
        "Stream": lambda: list(stub.Stream(pb.StreamRequest(table=TABLE, group=f"g_{who}", batch_size=1,
                                                            timeout_s=1), metadata=metadata, timeout=5)),
        "Ack": lambda: stub.Ack(pb.AckRequest(table=TABLE, group="g", item_ids=[1]), metadata=metadata,
                                timeout=5),
        "Nack": lambda: stub.Nack(pb.NackRequest(table=TABLE, group="g", item_ids=[1]), metadata=metadata,
                                  timeout=5),
        "UpdatePriorities": lambda: stub.UpdatePriorities(
            pb.UpdatePrioritiesRequest(table=TABLE, item_ids=[1], priorities=[2.0]), metadata=metadata,
            timeout=5),
        "SetPolicyVersion": lambda: stub.SetPolicyVersion(pb.SetPolicyVersionRequest(table=TABLE, version=0),
                                                          metadata=metadata, timeout=5),
        "Reserve": lambda: stub.Reserve(pb.ReserveRequest(table=PACED, count=1), metadata=metadata, timeout=5),
        "Release": lambda: stub.Release(pb.ReleaseRequest(table=PACED, reservation_id=1), metadata=metadata,
                                        timeout=5),
    }


@pytest.mark.parametrize("who", list(SECRETS) + ["ci"])
def test_each_rpc_is_allowed_or_denied_by_role(auth_server, who):
    secret, roles = SECRETS[who] if who in SECRETS else (ENV_SECRET, ["admin"])
    channel, stub = raw_stub(auth_server.address)
    try:
        for method, call in calls(stub, who, md(secret)).items():
            allowed = "admin" in roles or ROLE_OF_METHOD[method] in roles or ROLE_OF_METHOD[method] == "any"
            if allowed:
                call()  # must succeed
            else:
                err = rpc_error(call, grpc.StatusCode.PERMISSION_DENIED)
                assert repr(who) in err.details() and ROLE_OF_METHOD[method] in err.details(), err.details()
                assert secret not in err.details()
    finally:
        channel.close()


@pytest.mark.parametrize("metadata", [
    None,
    (("authorization", "Bearer not-a-known-token"),),
    (("authorization", f"Bearer {SECRETS['ops'][0]} "),),  # trailing space: not the token
    (("authorization", f"Bearer {SECRETS['ops'][0][:-1]}"),),  # a prefix of a real token
    (("authorization", f"Basic {SECRETS['ops'][0]}"),),
    (("authorization", SECRETS["ops"][0]),),
    (("x-token", SECRETS["ops"][0]),),
], ids=["missing", "unknown", "trailing-space", "prefix", "basic", "no-scheme", "other-header"])
def test_missing_or_invalid_token_is_unauthenticated(auth_server, metadata):
    channel, stub = raw_stub(auth_server.address)
    try:
        for method, call in calls(stub, "nobody", metadata).items():
            if method == "DropTable":
                call = lambda: stub.DropTable(pb.DropTableRequest(table=TABLE), metadata=metadata, timeout=5)
            err = rpc_error(call, grpc.StatusCode.UNAUTHENTICATED)
            assert SECRETS["ops"][0] not in err.details()
    finally:
        channel.close()
    with Client(auth_server.address, SECRETS["dashboard"][0]) as reader:
        assert reader.describe(TABLE).name == TABLE  # nothing was dropped or created


def test_client_with_token(auth_server):
    with Client(auth_server.address, SECRETS["learner"][0]) as trainer, \
            Client(auth_server.address, SECRETS["rollout-1"][0]) as producer:
        ids = producer.insert(TABLE, trajectories(2, id_prefix="client")).item_ids
        assert len(trainer.sample(TABLE, 2)) == 2
        assert trainer.update_priorities(TABLE, ids, [1.0, 1.0]).num_updated == 2
        err = rpc_error(lambda: trainer.insert(TABLE, trajectories(1, id_prefix="nope")),
                        grpc.StatusCode.PERMISSION_DENIED)
        assert "producer" in err.details()


def test_producer_token_can_insert_dicts(auth_server):
    with Client(auth_server.address, SECRETS["rollout-1"][0]) as producer:
        assert producer.insert(TABLE, trajectories(2, id_prefix="dicts").to_pylist()).num_inserted == 2


def test_secrets_never_logged_and_audit_records_calls(auth_server):
    # Make sure every kind of call happened at least once with each token (order-independent).
    for who in list(SECRETS) + ["ci"]:
        test_each_rpc_is_allowed_or_denied_by_role(auth_server, who)
    channel, stub = raw_stub(auth_server.address)
    rpc_error(lambda: stub.DropTable(pb.DropTableRequest(table=TABLE), metadata=md("wrong-Secret-xyz"),
                                     timeout=5), grpc.StatusCode.UNAUTHENTICATED)
    channel.close()
    # The audit writer thread appends within moments of each call.
    assert wait_until(lambda: any(x["method"] == "DropTable" and x["outcome"] == "UNAUTHENTICATED"
                                  for x in audit_lines(auth_server.data_dir)))

    log = auth_server.log
    audit_text = (auth_server.data_dir / "audit.jsonl").read_text()
    for secret in [s for s, _ in SECRETS.values()] + [ENV_SECRET, "wrong-Secret-xyz"]:
        assert secret not in log, "a token leaked into the server log"
        assert secret not in audit_text, "a token leaked into the audit log"

    lines = audit_lines(auth_server.data_dir)
    assert all({"ts", "who", "method", "table", "outcome"} <= set(line) for line in lines)
    assert {"who": "rollout-1", "method": "Insert", "table": TABLE, "outcome": "OK"}.items() <= \
        next(line for line in lines if line["who"] == "rollout-1" and line["method"] == "Insert").items()
    denied = [line for line in lines if line["method"] == "CreateTable" and line["outcome"] == "PERMISSION_DENIED"]
    assert len(denied) >= 3  # producer, trainer, reader tried
    assert any(line["method"] == "DropTable" and line["outcome"] == "UNAUTHENTICATED" for line in lines)
    assert any(line["who"] == "learner" and line["method"] == "SetPolicyVersion" and line["outcome"] == "OK"
               for line in lines)
    assert any(line["who"] == "ci" and line["method"] == "CreateTable" and line["outcome"] == "OK"
               for line in lines)
    # Reads are not audited.
    assert not any(line["method"] in ("Get", "Stats", "ListTables", "DescribeTable", "Sample")
                   for line in lines)


def test_audit_names_the_denied_principal_and_table(auth_server):
    channel, stub = raw_stub(auth_server.address)
    rpc_error(lambda: stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="sneaky")),
                                       metadata=md(SECRETS["dashboard"][0]), timeout=5),
              grpc.StatusCode.PERMISSION_DENIED)
    channel.close()
    assert wait_until(lambda: any(x["table"] == "sneaky" for x in audit_lines(auth_server.data_dir)))
    line = [x for x in audit_lines(auth_server.data_dir) if x["method"] == "CreateTable"][-1]
    assert line["outcome"] == "PERMISSION_DENIED"
    assert line["who"] == "dashboard" and line["table"] == "sneaky"


def test_no_auth_configured_allows_anonymous(shared_server, table_name):
    """Without [auth] tokens every call of every role is allowed, with or without a
    token (which is then ignored), and audited as "anonymous"."""
    for token in (None, "not-a-configured-token"):
        with Client(shared_server.address, token) as c:
            assert c.create_table(table_name, sampler="fifo").name == table_name  # admin
            ids = c.insert(table_name, trajectories(2, id_prefix=f"anon-{token}")).item_ids  # producer
            assert c.sample(table_name, 2).ids.tolist() == ids.tolist()  # trainer
            assert c.stats(table_name)[table_name]["items"] == 2  # reader
            c.drop_table(table_name)
            assert table_name not in [t.name for t in c.list_tables()]

    def audited():
        return [x for x in audit_lines(shared_server.data_dir) if x["table"] == table_name]

    assert wait_until(lambda: [x["method"] for x in audited()].count("DropTable") == 2)
    assert {(x["who"], x["outcome"]) for x in audited()} == {("anonymous", "OK")}
    assert [x["method"] for x in audited()] == ["CreateTable", "Insert", "DropTable"] * 2


# -- TLS --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    from ._util import start_server

    directory = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(directory)
    s = start_server(directory / "data", None, "--tls-cert", str(cert), "--tls-key", str(key))
    yield s, cert
    s.stop()


def test_tls_round_trip(tls_server):
    server, cert = tls_server
    with Client(server.address, tls=cert) as c:
        c.create_table("tls_t", if_not_exists=True)
        data = trajectories(5, id_prefix="tls")
        ids = c.insert("tls_t", data).item_ids
        assert c.get("tls_t", ids).data.column("tokens").to_pylist() == data.column("tokens").to_pylist()
        assert len(c.sample("tls_t", 3)) == 3
    port = server.address.rsplit(":", 1)[1]
    with Client(f"localhost:{port}", tls=cert.read_bytes()) as c:  # the DNS name, PEM bytes
        assert "tls_t" in [t.name for t in c.list_tables()]


def test_tls_async_client(tls_server):
    server, cert = tls_server

    async def main():
        async with AsyncClient(server.address, tls=cert) as c:
            await c.create_table("tls_async", if_not_exists=True)
            res = await c.insert("tls_async", trajectories(3, id_prefix="a"))
            return (await c.get("tls_async", res.item_ids)).data.column("traj_id").to_pylist()

    assert asyncio.run(main()) == ["a-0", "a-1", "a-2"]


def test_cli_over_tls(tls_server):
    server, cert = tls_server
    with Client(server.address, tls=cert) as c:
        c.create_table("tls_cli", if_not_exists=True)
    command = [sys.executable, "-m", "expstore_server.cli", "--server", server.address, "--timeout", "5"]
    ok = subprocess.run([*command, "--tls-ca", str(cert), "tables"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "tls_cli" in ok.stdout, ok.stderr
    env = {**os.environ, "EXPSTORE_TLS_CA": str(cert)}
    by_env = subprocess.run([*command, "tables"], capture_output=True, text=True, env=env, timeout=60)
    assert by_env.returncode == 0 and "tls_cli" in by_env.stdout, by_env.stderr
    plain = subprocess.run([*command, "tables"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 2 and "UNAVAILABLE" in plain.stderr, plain.stderr


def test_plaintext_client_to_tls_server_fails(tls_server):
    server, _ = tls_server
    channel, stub = raw_stub(server.address)
    err = rpc_error(lambda: stub.ListTables(pb.ListTablesRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE)
    channel.close()
    with Client(server.address, timeout=2) as c:
        rpc_error(lambda: c.list_tables(), grpc.StatusCode.UNAVAILABLE)
    assert server.proc.poll() is None
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_client_with_wrong_root_fails(tls_server, tmp_path):
    server, _ = tls_server
    other_cert, _ = self_signed(tmp_path)
    with Client(server.address, tls=other_cert, timeout=2) as c:
        rpc_error(lambda: c.list_tables(), grpc.StatusCode.UNAVAILABLE)


def test_tls_client_to_plaintext_server_fails(shared_server, tls_server):
    _, cert = tls_server
    with Client(shared_server.address, tls=cert, timeout=2) as c:
        rpc_error(lambda: c.list_tables(), grpc.StatusCode.UNAVAILABLE)
