"""expstore.audit: recomputed rewards against stored ones, failures per item."""

from __future__ import annotations

import hashlib
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from expstore import audit as au
from expstore.synthetic import trajectories

REWARDS = '''
import signal, time

def stored(row):
    return row["reward"]

def changed(row):  # rows whose traj_id ends in 7 get +0.5, with components
    v = row["reward"] + (0.5 if row["traj_id"].endswith("7") else 0.0)
    return v, {"base": row["reward"]}

class Result:
    def __init__(self, value, components):
        self.value, self.components = value, components

def as_object(row):
    return Result(row["reward"], {"base": row["reward"]})

def flaky(row):
    i = int(row["traj_id"].split("-")[1])
    if i == 3:
        raise RuntimeError("boom")
    if i == 5:
        time.sleep(60)   # the alarm interrupts it
    if i == 6:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)   # deaf to the alarm: the worker is killed
    if i == 8:
        return "not a number"
    return row["reward"]
'''


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "audit_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "audit_rewards.py"


def data(n: int = 30) -> pa.Table:
    t = trajectories(n, tasks=("math", "code"), reward=np.linspace(0, 1, n))
    t = t.append_column("item_id", pa.array(np.arange(1, n + 1), pa.uint64()))
    comps = pa.array([[("base", float(r))] for r in t.column("reward").to_pylist()], pa.map_(pa.string(), pa.float32()))
    return t.set_column(t.schema.get_field_index("reward_components"), "reward_components", comps) \
        if "reward_components" in t.schema.names else t.append_column("reward_components", comps)


def test_a_changed_reward_finds_exactly_the_changed_rows(rewards, tmp_path):
    t = data()
    same = au.audit(t.to_batches(max_chunksize=7), "audit_rewards:stored", workers=2)
    assert same.counts()["ok"] == 30 and same.failures == 0
    report = au.audit(t.to_batches(), "audit_rewards:changed", workers=2)
    r = report.results
    bad = r.filter(pa.compute.equal(r.column("status"), "mismatch"))
    assert sorted(bad.column("traj_id").to_pylist()) == ["traj-17", "traj-27", "traj-7"]
    assert bad.column("delta").to_numpy() == pytest.approx(0.5)
    assert r.column("components_match").to_pylist() == [True] * 30
    s = report.summary()
    assert s["count"] == 30 and s["mismatch"] == 3 and s["max_abs_delta"] == pytest.approx(0.5)
    assert {o["source_item_id"] for o in s["top_offenders"]} == {8, 18, 28}
    assert sum(k for _, _, k in s["histogram"]) == 30
    assert {row["task"]: row["failures"] for row in s["by"]["task"]} == {"code": 3, "math": 0}
    assert report.digest == "sha256:" + hashlib.sha256(rewards.read_bytes()).hexdigest()
    assert "top offenders" in report.format()
    report.write_parquet(str(tmp_path / "a.parquet"))
    back = pq.read_table(tmp_path / "a.parquet")
    assert back.num_rows == 30 and b"expstore.audit" in back.schema.metadata
    assert set(back.column("reward_digest").to_pylist()) == {report.digest}


def test_objects_and_components_are_compared(rewards):
    t = data(6)
    report = au.audit(t.to_batches(), "audit_rewards:as_object", workers=1)
    assert report.counts()["ok"] == 6 and report.results.column("components_match").to_pylist() == [True] * 6


def test_errors_and_hangs_are_recorded_per_item(rewards):
    report = au.audit(data(10).to_batches(), "audit_rewards:flaky", workers=2, timeout=0.5, grace=0.5)
    by_id = {r["traj_id"]: r for r in report.results.to_pylist()}
    assert by_id["traj-3"]["status"] == "error" and "boom" in by_id["traj-3"]["error"]
    assert by_id["traj-5"]["status"] == "timeout"
    assert by_id["traj-6"]["status"] == "timeout" and "killed" in by_id["traj-6"]["error"]
    assert by_id["traj-8"]["status"] == "error" and "number" in by_id["traj-8"]["error"]
    assert [by_id[f"traj-{i}"]["status"] for i in (0, 1, 2, 4, 7, 9)] == ["ok"] * 6
    assert report.failures == 4


def test_normalize_and_load():
    assert au.normalize(1) == (1.0, None)
    assert au.normalize((0.5, {"a": 1})) == (0.5, {"a": 1.0})
    with pytest.raises(TypeError):
        au.normalize("x")
    with pytest.raises(ValueError):
        au.normalize(float("nan"))
    with pytest.raises(ValueError, match="MODULE:FUNC"):
        au.load_reward("nocolon")
    with pytest.raises(ValueError, match="cannot import"):
        au.load_reward("no_such_module_xyz:f")
