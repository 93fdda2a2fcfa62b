"""Work with no natural bound has one: client-sent text in logs, decompressed payloads,
token ids, and SQL queries (time, memory, threads, files). A real server subprocess."""

from __future__ import annotations

import json
import logging
import re
import struct
import subprocess
import sys
import threading

import grpc
import numpy as np
import pyarrow as pa
import pytest

from expstore_client import Client
from expstore_server.clip import MESSAGE_CHARS
from expstore_server.main import JsonFormatter

from ._util import ipc_bytes, pb, raw_stub, rpc_error, trajectories, wait_until

HUGE = 50_000_000  # characters of a name a client may send in a 256 MiB message
IA = grpc.StatusCode.INVALID_ARGUMENT


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


# -- payloads that inflate: compression, dictionaries, rows too large to send back ------------

def peak_rss(server) -> int:
    """The server process's peak resident set (VmHWM), in bytes."""
    status = open(f"/proc/{server.proc.pid}/status").read()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024


def insert_raw(stub, table: str, payload: bytes):
    return stub.Insert(iter([pb.InsertRequest(table=table, arrow_ipc=payload)]), timeout=60)


def zero_tokens(n: int) -> bytes:
    """One row whose n token ids are all 0, zstd-compressed: 4n bytes in a few KB."""
    values = pa.array(np.zeros(n, np.int32))  # calloc'd: never touched, never resident
    return ipc_bytes(pa.table({"tokens": pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), values)}),
                     compress=True)


def test_a_zstd_bomb_is_refused_before_it_is_inflated(server_factory):
    s = server_factory()
    channel, stub = raw_stub(s.address)
    with Client(s.address) as c:
        c.create_table("bombed")
        c.insert("bombed", trajectories(8, tokens=1024))  # the server's usual allocations, made
        bomb = zero_tokens(100_000_000)  # 400 MB of token ids
        assert len(bomb) < 1 << 20
        before = peak_rss(s)
        err = rpc_error(lambda: insert_raw(stub, "bombed", bomb), IA)
        assert err.details().startswith("table 'bombed': insert message 0: its rows would take 4000000")
        assert err.details().endswith("bytes decompressed, more than max_message_bytes (268435456); "
                                      "send fewer rows per message")
        # A stream that declares a buffer of 4 TiB behind a frame of a few bytes.
        small = zero_tokens(1_000_000)
        declared = struct.pack("<q", 4_000_000)
        assert small.count(declared) == 1
        err = rpc_error(lambda: insert_raw(stub, "bombed", small.replace(declared, struct.pack("<q", 1 << 42))), IA)
        assert int(re.search(r"would take (\d+) bytes decompressed", err.details())[1]) >= 1 << 42
        assert peak_rss(s) - before < 64 << 20  # nothing was inflated
        assert c.insert("bombed", trajectories(2, id_prefix="after")).num_inserted == 2
        assert len(c.sample("bombed", 10)) == 10 and c.describe("bombed").num_items == 10
    channel.close()


def dictionary_strings(n: int, entry_bytes: int) -> pa.DictionaryArray:
    """n strings, each the same entry of entry_bytes: n * entry_bytes once expanded."""
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["d" * entry_bytes]))


def test_dictionary_bombs_and_rows_too_large_to_send_back_are_refused(server_factory):
    s = server_factory()
    channel, stub = raw_stub(s.address)
    with Client(s.address) as c:
        c.create_table("blobs", kind="generic", key_column="id",
                       schema=pa.schema([("id", pa.string()), ("text", pa.string()), ("parts", pa.list_(pa.string()))]))
        before = peak_rss(s)
        # One row: a list of 3,000 references to one 100 kB string is a 300 MB row.
        parts = pa.ListArray.from_arrays(pa.array([0, 3000], pa.int32()), dictionary_strings(3000, 100_000))
        payload = ipc_bytes(pa.table({"id": ["big"], "parts": parts}))
        assert len(payload) < 1 << 20
        err = rpc_error(lambda: insert_raw(stub, "blobs", payload), IA)
        assert re.fullmatch(r"table 'blobs': row 0 takes 3000\d{5} bytes, more than one response message can "
                            r"carry back \(268369920: max_message_bytes 268435456 less 65536 for framing\); "
                            r"split the trajectory or raise max_message_bytes", err.details()), err.details()
        # 3,000 rows of 100 kB each: every row could be sent back, all of them are 300 MB.
        payload = ipc_bytes(pa.table({"id": [f"r{i}" for i in range(3000)], "text": dictionary_strings(3000, 100_000)}))
        err = rpc_error(lambda: insert_raw(stub, "blobs", payload), IA)
        assert re.fullmatch(r"table 'blobs': insert message 0: its rows would take 3000\d{5} bytes with their "
                            r"dictionaries expanded, more than max_message_bytes \(268435456\); send fewer rows "
                            r"per message", err.details()), err.details()
        assert peak_rss(s) - before < 64 << 20
        assert c.describe("blobs").num_items == 0
        # Dictionaries that expand within bounds are conformed and stored as usual.
        c.insert("blobs", pa.table({"id": ["a", "b"], "text": dictionary_strings(2, 10)}))
        assert c.get("blobs", [1, 2]).data.column("text").to_pylist() == ["d" * 10] * 2
    channel.close()


def test_long_rows_among_short_ones_go_back_in_messages_within_the_limit(server_factory):
    s = server_factory("[server]\nmax_message_bytes = 4194304\nmessage_bytes = 1048576\n")
    with Client(s.address, message_bytes=1 << 20) as c:
        c.create_table("long")
        short = trajectories(40, tokens=64, id_prefix="s")
        long = trajectories(2, tokens=300_000, id_prefix="l")  # ~2.7 MB a row
        ids = c.insert("long", long, compress=True).item_ids.tolist() + c.insert("long", short).item_ids.tolist()
        got = c.get("long", ids)  # the two long rows first, side by side
        assert got.data.column("traj_id").to_pylist() == \
            long.column("traj_id").to_pylist() + short.column("traj_id").to_pylist()
        assert len(c.sample("long", 42)) == 42


# -- SQL queries: time, memory, files, their own threads ------------------------------------

# The small side of a join is held in memory: 1,000 rows keep this query at constant memory, so it
# meets the time limit, never the memory limit (a billion-row side fills 1 GiB in seconds).
CROSS_JOIN = "SELECT count(*) AS n FROM range(1000000000000) a, range(1000) b"
ENDLESS_CTE = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) AS n FROM r"


def run_in_thread(fn) -> tuple[threading.Thread, list]:
    """Start fn in a thread; the list gets its result or its exception."""
    out: list = []

    def target():
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append(e)
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def test_endless_queries_stop_at_their_time_limit_while_inserts_and_stats_go_on(server_factory):
    s = server_factory("[server]\nquery_timeout_s = 10\n")
    with Client(s.address) as c:
        c.create_table("busy")
        queries = [run_in_thread(lambda sql=sql: c.query_table(sql, timeout=120)) for sql in (CROSS_JOIN, ENDLESS_CTE)]
        for i in range(5):  # while both queries compute (each has a DuckDB thread busy)
            assert c.insert("busy", trajectories(4, id_prefix=f"b{i}"), timeout=30).num_inserted == 4
            assert c.stats("busy")["busy"]["items"] == 4 * (i + 1)
            assert len(c.sample("busy", 4, timeout=30)) == 4
        assert all(thread.is_alive() for thread, _ in queries), "the queries were running meanwhile"
        for thread, out in queries:
            thread.join(120)
            err = out[0]
            assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
            assert err.details().startswith("query stopped after 10 s of computing (query_timeout_s)"), err.details()
        assert c.query_table("SELECT count(*) AS n FROM busy").column("n").to_pylist() == [20]


def test_a_query_whose_client_went_away_frees_its_worker(server_factory):
    s = server_factory()  # two query workers, a five-minute time limit
    channel, stub = raw_stub(s.address)
    with Client(s.address) as c:
        c.create_table("t")
        c.insert("t", trajectories(3))
        for sql in (CROSS_JOIN, ENDLESS_CTE, CROSS_JOIN, ENDLESS_CTE):  # each would hold a worker for 5 minutes
            rpc_error(lambda: list(stub.Query(pb.QueryRequest(sql=sql), timeout=1)), grpc.StatusCode.DEADLINE_EXCEEDED)
        assert c.query_table("SELECT count(*) AS n FROM t", timeout=60).column("n").to_pylist() == [3]
        assert c.stats("t")["t"]["items"] == 3
    channel.close()


def test_a_full_query_pool_answers_resource_exhausted(server_factory):
    s = server_factory("[server]\nquery_workers = 1\nquery_queue = 0\nquery_timeout_s = 8\n")
    with Client(s.address) as c:
        endless = [run_in_thread(lambda: c.query_table(ENDLESS_CTE, timeout=120))]

        def refused() -> bool:
            thread, out = endless[0]
            if not thread.is_alive() and out[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                endless[0] = run_in_thread(lambda: c.query_table(ENDLESS_CTE, timeout=120))  # a probe had the place
                return False
            try:
                c.query_table("SELECT 1 AS one", timeout=30)
                return False  # ran before the endless one took the only place
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert "query_workers + query_queue" in e.details()
                return True
        assert wait_until(refused, timeout=30)
        thread, out = endless[0]
        thread.join(120)
        assert out[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert c.query_table("SELECT 1 AS one", timeout=30).column("one").to_pylist() == [1]


def test_a_query_past_its_memory_is_resource_exhausted(server_factory):
    s = server_factory("[server]\nquery_memory_bytes = 16777216\nquery_temp_bytes = 0\n")
    with Client(s.address) as c:
        err = rpc_error(lambda: c.query_table("SELECT count(DISTINCT y) AS n FROM (SELECT repeat('a', 100) || x::VARCHAR "
                                              "AS y FROM range(3000000) t(x))", timeout=120),
                        grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert err.details().startswith("query needs more memory than it may use (query_memory_bytes"), err.details()
        assert c.query_table("SELECT 42 AS x").column("x").to_pylist() == [42]


def test_queries_read_no_files_not_even_duckdbs_temp_dir(server_factory, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the server's working directory: DuckDB's default temp dir is ./.tmp
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "secret.csv").write_text("a,b\n1,secret\n")
    s = server_factory()
    with Client(s.address) as c:
        c.create_table("t")
        for sql in ("SELECT * FROM read_csv('.tmp/secret.csv')", "SELECT * FROM glob('.tmp/*')",
                    f"SELECT * FROM read_text('{tmp_path}/.tmp/secret.csv')",
                    f"SELECT * FROM read_text('{s.data_dir}/audit.jsonl')",
                    f"SELECT * FROM glob('{s.data_dir}/query-tmp/**')",
                    "SELECT * FROM read_text(current_setting('temp_directory') || '/../../audit.jsonl')"):
            err = rpc_error(lambda: c.query_table(sql), IA)
            assert "Permission Error" in err.details() or "disabled" in err.details(), (sql, err.details())
        # Its own spill directory is private and empty, and gone with the query.
        assert c.query_table("SELECT count(*) AS n FROM glob(current_setting('temp_directory') || '/*')") \
            .column("n").to_pylist() == [0]
        assert wait_until(lambda: list((s.data_dir / "query-tmp").iterdir()) == [])


def test_the_offline_cli_query_has_the_same_limits(server_factory, tmp_path):
    s = server_factory()
    with Client(s.address) as c:
        c.create_table("t")
        c.insert("t", trajectories(3))
    s.stop()
    config = tmp_path / "limits.toml"
    config.write_text("[server]\nquery_timeout_s = 2\n")
    p = subprocess.run([sys.executable, "-m", "expstore_server.cli", "--data-dir", str(s.data_dir), "--config",
                        str(config), "query", ENDLESS_CTE], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("expstore: query stopped after 2 s of computing"), p.stderr
    p = subprocess.run([sys.executable, "-m", "expstore_server.cli", "--data-dir", str(s.data_dir), "--config",
                        str(config), "query", "SELECT * FROM read_csv('.tmp/x.csv')"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "Permission Error" in p.stderr, p.stderr
