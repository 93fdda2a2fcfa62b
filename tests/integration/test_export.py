"""``expstore export``: Parquet shards and Hugging Face datasets directories, from a real
server and from a stopped server's data dir, through the CLI as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from expstore.schema import TRAJECTORY_V1
from expstore.synthetic import trajectories
from expstore_client import Client


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expstore_server.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "EXPSTORE_SERVER": "127.0.0.1:1"}, timeout=300)


def with_components(t: pa.Table) -> pa.Table:
    """The rows with a map column filled (reward_components), which datasets cannot hold as a map."""
    kind = TRAJECTORY_V1.field("reward_components").type
    return t.append_column("reward_components",
                           pa.array([[("pass", float(i % 2)), ("length", -0.5)] for i in range(t.num_rows)], kind))


@pytest.fixture
def rollouts(server_factory):
    server = server_factory()
    client = Client(server.address)
    client.create_table("rollouts")
    rows = with_components(trajectories(250, tokens=(10, 40), groups=50, seed=3))
    client.insert("rollouts", rows)
    yield server, client, rows
    client.close()


def test_export_writes_the_selected_rows_as_parquet_shards(rollouts, tmp_path):
    server, client, rows = rollouts
    out = tmp_path / "best"
    p = cli("--server", server.address, "export", "rollouts", "--where", "reward > 0.5", "--rows-per-shard", "40",
            "--out", str(out), "--progress", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    expected = client.query_table("SELECT * FROM rollouts WHERE reward > 0.5 ORDER BY item_id")
    n = expected.num_rows
    assert 40 < n < 250
    shards = sorted(out.iterdir())
    assert [s.name for s in shards] == [f"part-{i:05d}.parquet" for i in range((n + 39) // 40)]
    got = ds.dataset(out, format="parquet").to_table().sort_by("item_id")
    assert got.column_names == expected.column_names  # stored and server columns
    for name in ("traj_id", "tokens", "loss_mask", "logprobs", "reward", "reward_components", "item_id"):
        assert got.column(name).to_pylist() == expected.column(name).to_pylist(), name
    assert p.stdout == f"exported {n} rows of rollouts to {out} ({len(shards)} parquet shards)\n"
    assert out.stat().st_mode & 0o777 == 0o777 & ~_umask()  # a directory like any the user makes
    assert "export" in p.stderr and f"{n}/{n}" in p.stderr  # the progress bar, on stderr


def test_export_hf_writes_a_datasets_directory_that_load_from_disk_reads(rollouts, tmp_path):
    import datasets

    server, client, rows = rollouts
    out = tmp_path / "rollouts-hf"
    p = cli("--server", server.address, "export", "rollouts", "--columns",
            "traj_id, group_id, tokens, loss_mask, reward, reward_components, num_tokens", "--format", "hf",
            "--rows-per-shard", "100", "--out", str(out), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    loaded = datasets.load_from_disk(str(out))
    assert len(loaded) == 250
    assert loaded.column_names == ["traj_id", "group_id", "tokens", "loss_mask", "reward", "reward_components",
                                   "num_tokens"]
    by_id = {r["traj_id"]: r for r in loaded}
    for row in rows.to_pylist():
        got = by_id[row["traj_id"]]
        assert got["tokens"] == row["tokens"] and got["loss_mask"] == row["loss_mask"]
        assert got["reward"] == pytest.approx(row["reward"])
        assert got["num_tokens"] == len(row["tokens"])
        assert [(kv["key"], kv["value"]) for kv in got["reward_components"]] == row["reward_components"]
    assert len(list(out.glob("data-*.arrow"))) == 3  # 250 rows, 100 per shard


def test_export_reads_a_stopped_servers_data_dir(rollouts, tmp_path):
    server, client, rows = rollouts
    client.close()
    assert server.stop() == 0
    out = tmp_path / "offline"
    p = cli("--data-dir", str(server.data_dir), "export", "rollouts", "--where", "task = 'math'",
            "--out", str(out), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    got = ds.dataset(out, format="parquet").to_table()
    assert sorted(got.column("traj_id").to_pylist()) == sorted(rows.column("traj_id").to_pylist())


def test_export_refuses_an_existing_directory_and_leaves_nothing_behind_when_it_fails(rollouts, tmp_path):
    server, client, rows = rollouts
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep me")
    p = cli("--server", server.address, "export", "rollouts", "--out", str(existing), cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("expstore: ") and "exists" in p.stderr, p.stderr
    assert [f.name for f in existing.iterdir()] == ["mine.txt"]

    before = sorted(f.name for f in tmp_path.iterdir())
    for args in (["--where", "no_such_column > 1"], ["--columns", "tokens +"]):
        p = cli("--server", server.address, "export", "rollouts", *args, "--out", str(tmp_path / "bad"), cwd=tmp_path)
        assert p.returncode == 2 and p.stderr.startswith("expstore: ") and p.stderr.count("\n") == 1, p.stderr
    p = cli("--server", server.address, "export", "no_such_table", "--out", str(tmp_path / "bad"), cwd=tmp_path)
    assert p.returncode == 2 and "no_such_table" in p.stderr, p.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == before  # no output, no staging directory


def test_export_of_no_rows_is_one_empty_shard_with_the_schema(rollouts, tmp_path):
    server, client, rows = rollouts
    out = tmp_path / "none"
    p = cli("--server", server.address, "export", "rollouts", "--where", "reward > 2", "--out", str(out),
            cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    got = ds.dataset(out, format="parquet").to_table()
    assert got.num_rows == 0 and "tokens" in got.column_names
    assert p.stdout == f"exported 0 rows of rollouts to {out} (1 parquet shard)\n"
