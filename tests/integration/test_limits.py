"""Work with no natural bound has one: client-sent text in logs, decompressed payloads,
token ids, and SQL queries (time, memory, threads, files). A real server subprocess."""

from __future__ import annotations

import json
import logging

import grpc
import pyarrow as pa
import pytest

from expstore_client import Client
from expstore_server.clip import MESSAGE_CHARS
from expstore_server.main import JsonFormatter

from ._util import pb, raw_stub, rpc_error, trajectories, wait_until

HUGE = 50_000_000  # characters of a name a client may send in a 256 MiB message


def audit_entries(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# -- the audit log, status messages and JSON logs ----------------------------------------

def test_huge_names_are_clipped_in_the_audit_log_and_the_status(server_factory):
    s = server_factory('[auth]\ntokens = [{ name = "ops", token = "s3cret-ops", roles = ["admin"] }]\n')
    channel, stub = raw_stub(s.address)
    name = "x" * HUGE
    for _ in range(3):  # unauthenticated: refused, but audited with the name it gave
        rpc_error(lambda: stub.DropTable(pb.DropTableRequest(table=name), timeout=60), grpc.StatusCode.UNAUTHENTICATED)
    # An authenticated call whose error names the table: the message sent back is clipped.
    err = rpc_error(lambda: stub.DropTable(pb.DropTableRequest(table=name), timeout=60,
                                           metadata=[("authorization", "Bearer s3cret-ops")]),
                    grpc.StatusCode.NOT_FOUND)
    channel.close()
    assert len(err.details()) < MESSAGE_CHARS + 100 and "more characters]" in err.details()
    path = s.data_dir / "audit.jsonl"
    assert wait_until(lambda: len(audit_entries(path)) >= 4)
    assert path.stat().st_size < 8192
    entries = audit_entries(path)
    assert [e["outcome"] for e in entries] == ["UNAUTHENTICATED"] * 3 + ["NOT_FOUND"]
    assert all(e["table"].startswith("x" * 256 + "...[") and e["table"].endswith(f"[{HUGE - 256} more characters]")
               for e in entries)
    assert sum(len(line) for line in s.stderr_lines) < 100_000  # nor did it reach the JSON log


def test_audit_log_rotates_by_size_and_keeps_a_bounded_number_of_files(server_factory):
    s = server_factory('[server]\naudit_log_max_bytes = 16384\naudit_log_backups = 2\n'
                       '[auth]\ntokens = [{ name = "ops", token = "s3cret-ops", roles = ["admin"] }]\n')
    channel, stub = raw_stub(s.address)
    for i in range(400):  # ~400 bytes a line: about ten files' worth
        rpc_error(lambda: stub.DropTable(pb.DropTableRequest(table=f"{i:04d}" + "y" * 1000), timeout=30),
                  grpc.StatusCode.UNAUTHENTICATED)
    channel.close()
    path = s.data_dir / "audit.jsonl"
    assert wait_until(lambda: any(e["table"].startswith("0399") for e in audit_entries(path)))
    files = sorted(p.name for p in s.data_dir.iterdir() if p.name.startswith("audit.jsonl"))
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    assert all((s.data_dir / f).stat().st_size <= 16384 for f in files)
    kept = [e for f in reversed(files) for e in audit_entries(s.data_dir / f)]
    numbers = [int(e["table"][:4]) for e in kept]
    assert numbers == list(range(numbers[0], 400)) and numbers[0] > 0  # the newest, in order, whole lines


def test_json_log_fields_are_clipped():
    record = logging.makeLogRecord({"msg": "internal error", "table": "z" * 1_000_000, "levelname": "ERROR"})
    line = JsonFormatter().format(record)
    assert len(line) < 70_000 and json.loads(line)["table"].endswith("[934464 more characters]")


# -- token ids ------------------------------------------------------------------------------

def with_token(data: pa.Table, row: int, position: int, value: int) -> pa.Table:
    tokens = data.column("tokens").to_pylist()
    tokens[row][position] = value
    i = data.schema.get_field_index("tokens")
    return data.set_column(i, data.schema.field(i), pa.array(tokens, pa.list_(pa.int32())))


def test_token_ids_are_refused_below_zero_and_at_or_above_the_vocab_size(server_factory):
    s = server_factory('[[tables]]\nname = "configured"\nvocab_size = 50000\n')
    with Client(s.address) as c:
        c.create_table("free")
        c.create_table("small", vocab_size=1000)
        assert c.describe("configured").config["vocab_size"] == 50000
        assert c.describe("small").config["vocab_size"] == 1000
        assert "vocab_size" not in c.describe("free").config
        data = trajectories(4, tokens=16, id_prefix="v")  # ids in [0, 50000)
        for table, row, position, value, expected in [
                ("free", 2, 5, -2**31, "expected >= 0 (a token id)"),
                ("configured", 1, 0, -1, "expected a token id in [0, 50000) (the table's vocab_size)"),
                ("configured", 3, 15, 50000, "expected a token id in [0, 50000) (the table's vocab_size)")]:
            err = rpc_error(lambda: c.insert(table, with_token(data, row, position, value)),
                            grpc.StatusCode.INVALID_ARGUMENT)
            assert err.details() == f"table {table!r}: row {row}, column 'tokens': value {value} " \
                                    f"at token {position}; {expected}"
            assert c.describe(table).num_items == 0
        assert c.insert("configured", data).num_inserted == 4
        err = rpc_error(lambda: c.insert("small", data), grpc.StatusCode.INVALID_ARGUMENT)
        assert "column 'tokens'" in err.details() and "[0, 1000)" in err.details()
        err = rpc_error(lambda: c.create_table("g", kind="generic", schema=pa.schema([("x", pa.int32())]),
                                               vocab_size=10), grpc.StatusCode.INVALID_ARGUMENT)
        assert "vocab_size applies to trajectory tables" in err.details()
    s.stop()
    s = server_factory(None, "--data-dir", str(s.data_dir))  # a restart keeps the table's vocab_size
    with Client(s.address) as c:
        assert c.describe("small").config["vocab_size"] == 1000
        rpc_error(lambda: c.insert("small", data), grpc.StatusCode.INVALID_ARGUMENT)
