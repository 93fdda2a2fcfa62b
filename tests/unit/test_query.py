"""expstore.query: SQL over a store's tables, checked against the same computation in numpy."""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from expstore import query as q
from expstore.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from expstore.schema import TRAJECTORY_V1
from expstore.spec import TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.tiers.remote import RemoteTier

TURNS = TRAJECTORY_V1.field("turns").type


def with_tools(t: pa.Table, seed: int) -> pa.Table:
    """Rows with 0-2 tool-call turns after the prompt (and an assistant turn)."""
    rng = np.random.default_rng(seed)
    turns = []
    for n in t.column("tokens").to_pylist():
        k = int(rng.integers(0, 3))
        row = [{"role": "tool", "start": 8 + i, "end": 9 + i, "tool_name": "calc", "tool_args": f"{i}+1",
                "tool_result": str(i + 1)} for i in range(k)]
        turns.append(row + [{"role": "assistant", "start": 8 + k, "end": len(n)}])
    return t.set_column(t.schema.get_field_index("turns"), "turns", pa.array(turns, TURNS))


@pytest.fixture
def store():
    s = Catalog()
    table = s.create_table(TableSpec(name="rollouts", max_size=10_000))
    for v in range(5):  # one chunk per policy version
        table.insert(with_tools(trajectories(60, tokens=(10, 40), policy_version=v, seed=v, id_prefix=f"v{v}",
                                             tasks=("math", "code", "chat")), seed=v))
    s.create_table(TableSpec(name="notes", kind="generic", schema=pa.schema([("note", pa.string())]))) \
        .insert(pa.table({"note": ["a", "b"]}))
    yield s
    s.close()


def run(store, sql, **kw) -> pa.Table:
    return q.query(q.store_sources(store), sql, **kw).read_all()


def everything(store) -> pa.Table:
    return pa.Table.from_batches(list(store.table("rollouts").scan()))


def test_group_by_matches_numpy(store):
    got = run(store, "SELECT task, policy_version, count(*) AS n, avg(reward) AS r, sum(num_generated) AS g "
                     "FROM rollouts GROUP BY ALL ORDER BY task, policy_version")
    t = everything(store)
    task, pv = np.array(t.column("task").to_pylist()), t.column("policy_version").to_numpy()
    reward = t.column("reward").to_numpy()
    generated = np.array([sum(m) for m in t.column("loss_mask").to_pylist()])
    assert got.num_rows == 15
    for row in got.to_pylist():
        sel = (task == row["task"]) & (pv == row["policy_version"])
        assert row["n"] == sel.sum()
        assert row["r"] == pytest.approx(reward[sel].astype(np.float64).mean())
        assert int(row["g"]) == generated[sel].sum()


def test_derived_and_server_columns(store):
    got = run(store, "SELECT traj_id, num_tokens, num_generated, num_turns, num_tool_calls, item_id, tier, "
                     "times_sampled FROM rollouts ORDER BY item_id")
    t = everything(store)
    turns = t.column("turns").to_pylist()
    assert got.column("num_tokens").to_pylist() == [len(x) for x in t.column("tokens").to_pylist()]
    assert got.column("num_generated").to_pylist() == [sum(m) for m in t.column("loss_mask").to_pylist()]
    assert got.column("num_turns").to_pylist() == [len(x) for x in turns]
    assert got.column("num_tool_calls").to_pylist() == [sum(1 for x in r if x["tool_name"]) for r in turns]
    assert got.column("item_id").to_pylist() == list(range(1, 301))
    assert set(got.column("tier").to_pylist()) == {"memory"}


def test_list_functions_and_generic_tables(store):
    got = run(store, "SELECT count(*) AS n FROM rollouts WHERE list_contains(list_transform(turns, lambda x: x.tool_name), 'calc')")
    t = everything(store)
    assert got.column("n")[0].as_py() == sum(1 for r in t.column("turns").to_pylist() if any(x["tool_name"] for x in r))
    assert run(store, "SELECT note FROM notes ORDER BY note").column("note").to_pylist() == ["a", "b"]
    assert "num_tokens" not in run(store, "SELECT * FROM notes").schema.names


def test_only_referenced_columns_are_scanned(store, monkeypatch):
    calls = []
    table = store.table("rollouts")
    scan = table.scan
    monkeypatch.setattr(table, "scan", lambda columns=None, **kw: calls.append((columns, kw)) or scan(columns, **kw))
    run(store, "SELECT task, sum(num_generated) FROM rollouts GROUP BY task")
    assert sorted(calls[0][0]) == ["loss_mask", "task"]
    calls.clear()
    run(store, "SELECT count(*) FROM rollouts")
    assert calls[0][0] == []
    calls.clear()
    run(store, "SELECT * FROM rollouts LIMIT 1")
    assert calls[0][0] == list(TRAJECTORY_V1.names)


def test_chunk_pruning_by_policy_version_and_time(store, monkeypatch):
    calls = []
    table = store.table("rollouts")
    scan = table.scan
    monkeypatch.setattr(table, "scan", lambda columns=None, **kw: calls.append(kw) or scan(columns, **kw))
    got = run(store, "SELECT count(*) AS n FROM rollouts r WHERE r.policy_version > 2 AND policy_version <= 3.5")
    assert got.column("n")[0].as_py() == 60
    assert calls[-1]["min_policy_version"] == 3 and calls[-1]["max_policy_version"] == 3
    at = np.sort(everything(store).column("inserted_at").to_numpy())
    cut = float(at[150])
    got = run(store, f"SELECT count(*) AS n FROM rollouts WHERE inserted_at >= {cut!r}")
    assert got.column("n")[0].as_py() == (at >= cut).sum()
    assert calls[-1]["inserted_after"] < cut
    # not a plain conjunct: no pruning, same answer
    got = run(store, "SELECT count(*) AS n FROM rollouts WHERE policy_version = 1 OR policy_version = 4")
    assert got.column("n")[0].as_py() == 120 and calls[-1]["min_policy_version"] is None


def test_plan_bounds_of_several_references():
    schema = {"t": pa.schema([("policy_version", pa.int64()), ("inserted_at", pa.float64()), ("x", pa.int64())])}
    p = q.plan("SELECT * FROM t WHERE policy_version BETWEEN 2 AND 4 UNION ALL "
               "SELECT * FROM t WHERE policy_version IN (7, 9)", schema)
    assert p["t"][1] == q.Bounds(min_pv=2, max_pv=9)
    p = q.plan("SELECT a.x FROM t a JOIN t b USING (x) WHERE a.policy_version > 3", schema)
    assert p["t"] == ({"x", "policy_version"}, q.Bounds())
    p = q.plan("SELECT a FROM t AS r(a) WHERE a >= 1 AND inserted_at > 5 ORDER BY ALL", schema)
    assert p["t"] == (set(schema["t"].names), q.Bounds())
    p = q.plan("SELECT x FROM t WHERE policy_version >= 1 ORDER BY ALL", schema)
    assert p["t"] == ({"x", "policy_version"}, q.Bounds(min_pv=1))
    p = q.plan("WITH t AS (SELECT 1 AS x) SELECT x FROM t", schema)
    assert p == {}  # a CTE named like the table: scanned whole, never pruned


def test_errors_are_one_line(store):
    for sql, words in [("SELEC 1", "syntax error"), ("SELECT nope FROM rollouts", "nope"),
                       ("SELECT * FROM missing", "missing"), ("SELECT 1; SELECT 2", "one SELECT"),
                       ("DELETE FROM rollouts", "SELECT"), ("SELECT * FROM read_csv('/etc/passwd')", "disabled")]:
        with pytest.raises(InvalidArgument) as e:
            run(store, sql)
        assert words in str(e.value) and "\n" not in str(e.value), sql


def test_results_stream_in_batches_and_max_rows(store):
    reader = q.query(q.store_sources(store), "SELECT item_id FROM rollouts ORDER BY item_id", batch_rows=64)
    sizes = [b.num_rows for b in reader]
    assert sum(sizes) == 300 and len(sizes) > 1
    got = run(store, "SELECT item_id FROM rollouts ORDER BY item_id", max_rows=7)
    assert got.column("item_id").to_pylist() == list(range(1, 8))


def test_archived_items_are_queryable(tmp_path):
    uri = (tmp_path / "remote").as_uri()
    store = Catalog(tmp_path / "data", remote=lambda name: RemoteTier(uri, name))
    table = store.create_table(TableSpec(name="r", tiers="remote", archive=True, max_size=50))
    for v in range(4):
        table.insert(trajectories(25, policy_version=v, seed=v, id_prefix=f"v{v}"))
    while table.archive_pending():
        pass
    got = run(store, "SELECT tier = 'archive' AS archived, count(*) AS n, min(item_id) AS lo, max(item_id) AS hi "
                     "FROM r GROUP BY ALL ORDER BY archived")
    assert got.to_pylist() == [{"archived": False, "n": 50, "lo": 51, "hi": 100},
                               {"archived": True, "n": 50, "lo": 1, "hi": 50}]
    assert run(store, "SELECT count(*) AS n FROM r WHERE tier = 'archive' AND policy_version = 1"
               ).column("n")[0].as_py() == 25
    assert run(store, "SELECT sum(num_tokens) AS n FROM r WHERE tier = 'archive'").column("n")[0].as_py() == 50 * 64
    store.close()
    # the archive directory alone, read-only
    sources = q.remote_sources(uri)
    assert "r.archive" in sources
    got = q.query(sources, 'SELECT count(*) AS n, min(item_id) AS lo FROM "r.archive"').read_all()
    assert got.to_pylist() == [{"n": 50, "lo": 1}]


# -- limits: time, memory, files, closing from another thread -----------------------------------

ENDLESS = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) AS n FROM r"


def test_an_endless_query_stops_at_its_time_limit(store, tmp_path):
    limits = q.Limits(timeout_s=0.5, temp_root=str(tmp_path / "spill"))
    with pytest.raises(DeadlineExceeded, match=r"^query stopped after 0.5 s of computing \(query_timeout_s\)"):
        run(store, ENDLESS, limits=limits)
    assert list((tmp_path / "spill").iterdir()) == []  # its spill directory went with it


def test_time_between_batches_does_not_count(store):
    reader = q.query(q.store_sources(store), "SELECT i FROM range(300000) t(i)", batch_rows=65_536,
                     limits=q.Limits(timeout_s=1.0))
    first = reader.read_next_batch()
    time.sleep(1.5)  # a slow reader: not the query's computing time
    assert first.num_rows + sum(b.num_rows for b in reader) == 300_000


def test_close_from_another_thread_interrupts_a_running_query(store):
    query = q.Query(q.Limits(timeout_s=600))
    started = threading.Event()
    out: list = []

    def run_it():
        started.set()
        try:
            query.start(q.store_sources(store), ENDLESS)
        except Exception as e:  # noqa: BLE001
            out.append(e)
    thread = threading.Thread(target=run_it)
    thread.start()
    started.wait()
    time.sleep(0.3)  # let DuckDB get going (closing earlier is fine too: it never starts)
    query.close()
    thread.join(60)
    assert not thread.is_alive() and isinstance(out[0], Unavailable), out
    query.close()  # idempotent


def test_memory_past_the_limit_is_resource_exhausted(store):
    limits = q.Limits(memory_bytes=16 << 20, temp_bytes=0)
    with pytest.raises(ResourceExhausted, match=r"^query needs more memory than it may use"):
        run(store, "SELECT count(DISTINCT repeat('a', 100) || x::VARCHAR) AS n FROM range(3000000) t(x)", limits=limits)
    assert run(store, "SELECT count(*) AS n FROM rollouts", limits=limits).column("n").to_pylist() == [300]


def test_no_file_is_readable_not_even_in_the_temp_dirs(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "secret.csv").write_text("a,b\n1,secret\n")
    spill = tmp_path / "spill"
    other = spill / "query-left-by-another"  # another query's (or a dead process's) spill directory
    other.mkdir(parents=True)
    (other / "block.csv").write_text("a\n1\n")
    (spill / "keep.txt").write_text("not a query's")
    limits = q.Limits(temp_root=str(spill))
    for sql in ["SELECT * FROM read_csv('.tmp/secret.csv')", "SELECT * FROM glob('.tmp/*')",
                f"SELECT * FROM read_csv('{other}/block.csv')", f"SELECT * FROM glob('{spill}/*')",
                "SELECT * FROM read_text(current_setting('temp_directory') || '/../keep.txt')",
                "SELECT * FROM read_parquet('/etc/passwd')"]:
        with pytest.raises(InvalidArgument, match="Permission Error"):
            run(store, sql, limits=limits)
    assert run(store, "SELECT count(*) AS n FROM glob(current_setting('temp_directory') || '/*')",
               limits=limits).column("n").to_pylist() == [0]
    assert sorted(p.name for p in spill.iterdir()) == ["keep.txt", "query-left-by-another"]  # each removed its own
    q.remove_leftover_temp(spill)  # what a restarted server does: query-* directories only
    assert sorted(p.name for p in spill.iterdir()) == ["keep.txt"]
