"""The ``expstore`` CLI through a subprocess, against a real server and offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from expstore.schema import TRAJECTORY_V1
from expstore.synthetic import trajectories
from expstore_client import Client
from expstore_server.cli import build_parser

from ._util import wait_until

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
TURNS = TRAJECTORY_V1.field("turns").type

HELPERS = '''
def stored(row):
    return row["reward"]

def changed(row):
    return row["reward"] + (1.0 if row["task"] == "code" and row["policy_version"] == 1 else 0.0)

def calc(args):
    return str(eval(args))

def search(args):
    return "new results"
'''


def cli(*args: str, server=None, cwd=None) -> subprocess.CompletedProcess:
    prefix = ["--server", server.address] if server is not None else []
    return subprocess.run([sys.executable, "-m", "expstore_server.cli", *prefix, *args], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ, "EXPSTORE_SERVER": "127.0.0.1:1"}, timeout=120)


def failed(p: subprocess.CompletedProcess, words: str) -> None:
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith("expstore: ") and p.stderr.count("\n") == 1 and words in p.stderr, p.stderr


def with_tools(t: pa.Table) -> pa.Table:
    turns = [[{"role": "assistant", "start": 0, "end": 4},
              {"role": "tool", "start": 4, "end": 6, "tool_name": "calc", "tool_args": "1+2", "tool_result": "3",
               "tool_status": "ok"},
              {"role": "tool", "start": 6, "end": 8, "tool_name": "search", "tool_args": "q", "tool_result": "old"},
              {"role": "assistant", "start": 8, "end": len(x)}] for x in t.column("tokens").to_pylist()]
    return t.set_column(t.schema.get_field_index("turns"), "turns", pa.array(turns, TURNS))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import importlib.util

    conftest = Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("_cli_conftest", conftest)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    root = tmp_path_factory.mktemp("cli")
    (root / "cli_helpers.py").write_text(textwrap.dedent(HELPERS))
    server = mod.start_server(root / "data")
    c = Client(server.address)
    c.create_table("rollouts", max_size=1000)
    parts = [with_tools(trajectories(40, tasks=("math", "code"), policy_version=v, seed=v, id_prefix=f"v{v}"))
             for v in range(3)]
    for p in parts:
        c.insert("rollouts", p)
    c.sample("rollouts", 5, step=7)
    yield server, c, root, pa.concat_tables(parts)
    c.close()
    server.stop()


def test_tables_describe_stats(served):
    server, _, _, _ = served
    p = cli("tables", server=server)
    assert p.returncode == 0 and re.search(r"rollouts\s+trajectory\s+120", p.stdout), p.stdout
    p = cli("describe", "rollouts", server=server)
    assert p.returncode == 0 and "num_tool_calls" in p.stdout and '"max_size": 1000' in p.stdout
    p = cli("stats", "rollouts", server=server)
    assert p.returncode == 0 and re.search(r"\bitems\s+120\b", p.stdout)


def test_query_formats(served, tmp_path):
    server, _, _, data = served
    sql = "SELECT task, policy_version, count(*) AS n, sum(num_tool_calls) AS calls FROM rollouts GROUP BY ALL ORDER BY ALL"
    p = cli("query", sql, "--format", "json", server=server)
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert p.returncode == 0 and len(rows) == 6 and all(r["n"] == 20 and int(r["calls"]) == 40 for r in rows)
    p = cli("query", sql, server=server)
    assert p.returncode == 0 and "(6 rows)" in p.stdout and p.stdout.splitlines()[0].split() == ["task", "policy_version", "n", "calls"]
    p = cli("query", "SELECT traj_id, tokens FROM rollouts ORDER BY item_id", "--format", "csv", "--max-rows", "3", server=server)
    lines = p.stdout.splitlines()
    assert lines[0] == "traj_id,tokens" and len(lines) == 4
    assert json.loads(lines[1].split(",", 1)[1].strip('"')) == data.column("tokens")[0].as_py()
    out = tmp_path / "r.parquet"
    p = cli("query", "SELECT item_id, reward FROM rollouts", "--format", "parquet", "--out", str(out), server=server)
    got = pq.read_table(out)
    assert p.returncode == 0 and got.num_rows == 120
    assert np.allclose(np.sort(got.column("reward").to_numpy()), np.sort(data.column("reward").to_numpy()))
    p = cli("query", "SELECT * FROM rollouts", server=server)  # truncated: 50 rows shown
    assert p.returncode == 0 and "more rows not shown" in p.stdout and len(p.stdout.splitlines()) == 53


def test_bad_input_is_one_line_and_exit_2(served):
    server, _, _, _ = served
    failed(cli("query", "SELEC 1", server=server), "syntax error")
    failed(cli("query", "SELECT nope FROM rollouts", server=server), '"nope"')
    failed(cli("query", "SELECT * FROM missing", server=server), "missing")
    failed(cli("describe", "missing", server=server), "NOT_FOUND")
    failed(cli("show", "rollouts", "99999", server=server), "no item")
    failed(cli("query"), "sql")
    failed(cli("tables"), "cannot reach the server at 127.0.0.1:1")


def test_show_and_manifest(served):
    server, c, _, _ = served
    p = cli("show", "rollouts", "2", server=server)
    assert p.returncode == 0 and "traj_id" in p.stdout and "tool calc(1+2)" in p.stdout and "logprob" in p.stdout
    assert "\033[" not in p.stdout  # no colour without a terminal
    ids, _ = c.manifest("rollouts", 7)
    p = cli("manifest", "rollouts", "--step", "7", server=server)
    assert p.returncode == 0 and "5 items" in p.stdout and all(str(i) in p.stdout for i in ids)


def test_audit_exit_codes_and_outputs(served, tmp_path):
    server, c, root, _ = served
    p = cli("audit", "rollouts", "--reward", "cli_helpers:stored", "--workers", "2", server=server, cwd=root)
    assert p.returncode == 0 and "items 120: ok 120" in p.stdout, p.stdout + p.stderr
    out = tmp_path / "audit.parquet"
    p = cli("audit", "rollouts", "--reward", "cli_helpers:changed", "--where", "task = 'code'", "--workers", "2",
            "--out", str(out), server=server, cwd=root)
    assert p.returncode == 1 and "items 60: ok 40, mismatch 20" in p.stdout, p.stdout + p.stderr
    bad = [r["traj_id"] for r in pq.read_table(out).to_pylist() if r["status"] == "mismatch"]
    assert len(bad) == 20 and {t.split("-")[0] for t in bad} == {"v1"}
    p = cli("audit", "rollouts", "--reward", "cli_helpers:changed", "--limit", "50", "--max-mismatch", "5",
            "--out", "audits", "--workers", "1", server=server, cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr  # of the first 50 items, v1's first 5 code rows mismatch
    assert c.query_table("SELECT count(*) AS n FROM audits WHERE status = 'mismatch'").column("n")[0].as_py() == 5
    failed(cli("audit", "rollouts", "--reward", "cli_helpers:nope", server=server, cwd=root), "no function")


def test_replay_reports_the_first_divergence(served):
    server, _, root, _ = served
    p = cli("replay", "rollouts", "1", "--tools", "cli_helpers", server=server, cwd=root)
    assert p.returncode == 1 and "turn 1: calc" in p.stdout and "same" in p.stdout
    assert "first divergence: turn 2" in p.stdout


def test_checkpoint(served):
    server, _, _, _ = served
    p = cli("checkpoint", "cli-test", server=server)
    assert p.returncode == 0 and "checkpoint cli-test" in p.stdout, p.stderr


def test_offline_data_dir_and_remote(server_factory):
    server = server_factory("""
        [[tables]]
        name = "arch"
        tiers = "remote"
        archive = true
        max_size = 30
    """)
    c = Client(server.address)
    for v in range(3):  # max_size 30: the first chunk (20 items) leaves whole and is archived
        c.insert("arch", trajectories(20, policy_version=v, seed=v, id_prefix=f"v{v}"))
    assert wait_until(lambda: c.query_table("SELECT count(*) AS n FROM arch WHERE tier = 'archive'")
                      .column("n")[0].as_py() == 20, timeout=30)
    c.close()
    failed(cli("--data-dir", str(server.data_dir), "tables"), "in use")
    server.stop()
    p = cli("--data-dir", str(server.data_dir), "query",
            "SELECT tier = 'archive' AS archived, count(*) AS n FROM arch GROUP BY ALL ORDER BY ALL", "--format", "json")
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert p.returncode == 0 and rows == [{"archived": False, "n": 30}, {"archived": True, "n": 20}], p.stdout + p.stderr
    remote = (server.data_dir / "remote").as_uri()
    p = cli("--remote", remote, "query", 'SELECT count(*) AS n FROM "arch.archive"', "--format", "json")
    assert p.returncode == 0 and json.loads(p.stdout) == {"n": 20}, p.stderr
    failed(cli("--remote", remote, "stats"), "--remote")
    failed(cli("--data-dir", str(server.data_dir / "nope"), "tables"), "not an expstore data dir")


def test_every_flag_and_command_is_documented():
    documented = set(re.findall(r"`([^`]+)`", DOCS.read_text()))
    parser = build_parser()
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    for name, p in parser._subparsers._group_actions[0].choices.items():
        assert f"expstore {name}" in " ".join(documented), name
        flags |= {s for a in p._actions for s in a.option_strings if s.startswith("--")}
    assert flags - {"--help", "--no-progress"} - documented == set()
