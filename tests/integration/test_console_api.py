"""The console's JSON API (expstore_server.console) against a real server subprocess: its
figures are the store's, its errors are the store's, its limits hold."""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections import Counter, defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from expstore.synthetic import trajectories  # noqa: E402
from expstore_client import Client  # noqa: E402
from expstore_rl.rewards import exact_match  # noqa: E402
from expstore_rl.tokenizer import CharTokenizer  # noqa: E402
from expstore_server.console import hacking, store  # noqa: E402
from expstore_server.console.app import Console, create_app  # noqa: E402
from expstore_server.console.audits import Runner  # noqa: E402
from expstore_server.console.store import Gateway  # noqa: E402
from expstore_server.console.tokenizers import Tokenizers  # noqa: E402

from ._console import TOKENIZER, agent_rows, generated  # noqa: E402

H = {"X-Expstore-Console": "1"}
REWARD = "expstore_rl.rewards:exact_match"


def console_for(address: str, **kw) -> TestClient:
    gateway = Gateway(address, timeout=30.0)
    app = create_app(Console(gateway, Tokenizers(), Runner((REWARD,), workers=1), loopback_only=False, **kw))
    return TestClient(app, base_url="http://127.0.0.1")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A server with an agent table (CharTokenizer metadata), a quick-start table and a
    step-7 manifest."""
    from ._util import start_server

    s = start_server(tmp_path_factory.mktemp("console") / "data")
    c = Client(s.address)
    c.create_table("agent", sampler="uniform", metadata={"tokenizer": TOKENIZER})
    rows = agent_rows()
    c.insert("agent", rows)
    c.create_table("rollouts", sampler={"type": "prioritized", "alpha": 0.6, "beta": 0.4}, max_size=100_000)
    c.insert("rollouts", trajectories(64, tokens=32))
    c.sample("agent", 8, step=7)
    c.create_table("queue", sampler="fifo")
    c.insert("queue", trajectories(10, id_prefix="q"))
    next(iter(c.stream("queue", group="trainer", batch_size=4, idle_timeout=1.0)))  # 4 in flight, 6 lagging
    yield s, c, rows
    c.close()
    s.stop()


def test_tables_show_the_stores_stats(loaded):
    s, c, _ = loaded
    http = console_for(s.address)
    got = {t["name"]: t for t in http.get("/api/tables").json()["tables"]}
    stats = c.stats()
    assert set(got) == {"agent", "rollouts", "queue"}
    for name, t in got.items():
        f, st = t["figures"], stats[name]
        assert f["items"] == st["items"] == t["num_items"]
        assert {tier: v["items"] for tier, v in f["tiers"].items()} == \
               {tier: st.get(f"items_{tier}") for tier in ("memory", "ssd", "remote")}
        assert f["waits"]["sample"]["calls"] == st["sample_waits"]
    assert got["agent"]["config"]["metadata"] == {"tokenizer": TOKENIZER}
    assert got["queue"]["figures"]["groups"]["trainer"]["lag"] == stats["queue"]["group.trainer.lag"] == 6
    assert got["queue"]["figures"]["groups"]["trainer"]["inflight"] == 4
    assert got["agent"]["figures"]["staleness"]["sample"]["total"] == stats["agent"]["samples"] == 8


def test_rates_come_from_two_snapshots(loaded, monkeypatch):
    s, c, _ = loaded
    http = console_for(s.address)
    monkeypatch.setattr(store, "STATS_TTL_S", 0.0)
    monkeypatch.setattr(store, "MIN_RATE_SPAN_S", 0.0)
    first = {t["name"]: t for t in http.get("/api/tables").json()["tables"]}
    assert first["rollouts"]["figures"]["rates"]["inserted"] is None  # one snapshot: no rate yet
    c.insert("rollouts", trajectories(16, tokens=32, id_prefix="more"))
    second = {t["name"]: t for t in http.get("/api/tables").json()["tables"]}
    assert second["rollouts"]["figures"]["rates"]["inserted"] > 0
    assert len(second["rollouts"]["rates"]["inserted"]) == 1


def test_sql_grid_pages_and_downloads(loaded):
    s, c, _ = loaded
    http = console_for(s.address)
    sql = "SELECT item_id, traj_id, reward, tokens FROM rollouts ORDER BY item_id"
    first = http.post("/api/query", json={"sql": sql, "page_rows": 30}, headers=H).json()
    expected = c.query_table(sql)
    assert first["total_rows"] == expected.num_rows and first["pages"] == -(-expected.num_rows // 30)
    assert [r[0] for r in first["rows"]] == expected.column("item_id").to_pylist()[:30]
    assert first["rows"][0][3].endswith(f", … ({len(expected.column('tokens')[0])} items)]")  # cut for the grid
    last = http.get("/api/result", params={"id": first["result_id"], "page": first["pages"] - 1,
                                           "page_rows": 30}).json()
    assert [r[1] for r in last["rows"]] == expected.column("traj_id").to_pylist()[30 * (first["pages"] - 1):]
    text = http.get("/api/download", params={"sql": sql, "format": "csv"}).text
    lines = list(csv.reader(io.StringIO(text)))
    assert lines[0] == expected.schema.names and len(lines) == expected.num_rows + 1
    assert json.loads(lines[1][3]) == expected.column("tokens")[0].as_py()  # every token, not the grid's cut
    data = http.get("/api/download", params={"sql": sql, "format": "parquet"}).content
    assert pq.read_table(io.BytesIO(data)).equals(expected)


def test_grid_keeps_at_most_grid_rows(loaded, monkeypatch):
    s, _, _ = loaded
    monkeypatch.setattr(store, "GRID_ROWS", 10)
    r = console_for(s.address).post("/api/query", json={"sql": "SELECT * FROM rollouts"}, headers=H).json()
    assert r["total_rows"] == 10 and r["truncated"] is True


def test_bad_sql_is_the_stores_invalid_argument(loaded):
    s, _, _ = loaded
    r = console_for(s.address).post("/api/query", json={"sql": "SELECT nope FROM rollouts"}, headers=H)
    assert r.status_code == 400 and r.json()["code"] == "INVALID_ARGUMENT" and "nope" in r.json()["error"]
    r = console_for(s.address).get("/api/download", params={"sql": "SELECT nope FROM rollouts"})
    assert r.status_code == 400 and "nope" in r.json()["error"]


def test_item_is_decoded_turn_by_turn_with_the_tables_tokenizer(loaded):
    s, c, rows = loaded
    http = console_for(s.address)
    item_id = c.query_table("SELECT item_id FROM agent WHERE traj_id = 't-7'").column(0)[0].as_py()
    item = http.get("/api/item", params={"table": "agent", "id": item_id}).json()
    row = rows[7]
    tok = CharTokenizer()
    assert item["tokenizer"]["spec"] == TOKENIZER
    assert item["tokens"]["pieces"] == [tok.decode([t]) for t in row["tokens"]]
    assert item["tokens"]["loss_mask"] == row["loss_mask"] and item["tokens"]["token_policy_version"] == row["token_policy_version"]
    assert [s["title"] for s in item["segments"]] == ["prompt", "turn 0: assistant", "turn 1: tool", "turn 2: assistant"]
    assert item["segments"][0]["text"] == tok.decode(row["tokens"][:row["turns"][0]["start"]])
    assert item["segments"][2]["tool"] == {k: row["turns"][1][k] for k in
                                           ("tool_name", "tool_args", "tool_result", "tool_status", "latency_ms")}
    assert item["reward"] == row["reward"] and item["reward_components"] == row["reward_components"]
    assert item["step_rewards"] == row["step_rewards"]
    assert json.loads(item["metadata"]) == json.loads(row["metadata"])
    assert item["facts"]["group_id"] == row["group_id"] and item["facts"]["num_generated"] == generated(row)

    group = http.get("/api/group", params={"table": "agent", "group_id": row["group_id"]}).json()
    members = [r for r in rows if r["group_id"] == row["group_id"]]
    assert sorted(g["traj_id"] for g in group["items"]) == sorted(r["traj_id"] for r in members)
    assert [g["reward"] for g in group["items"]] == sorted((r["reward"] for r in members), reverse=True)
    first = next(r for r in members if r["traj_id"] == group["items"][0]["traj_id"])
    assert group["items"][0]["text"] == tok.decode(first["tokens"][first["turns"][0]["start"]:])
    zero = http.get("/api/group", params={"table": "agent", "group_id": "t-v0-g0"}).json()
    assert zero["zero_variance"] is True and group["zero_variance"] is False


def test_a_tokenizer_outside_the_allowed_modules_is_not_loaded(loaded):
    s, c, _ = loaded
    c.create_table("sneaky", metadata={"tokenizer": "os:getcwd"}, if_not_exists=True)
    c.insert("sneaky", trajectories(1, tokens=12, id_prefix="s"))
    item_id = c.query_table("SELECT item_id FROM sneaky").column(0)[0].as_py()
    item = console_for(s.address).get("/api/item", params={"table": "sneaky", "id": item_id}).json()
    assert "pieces" not in item["tokens"]
    assert "module 'os' is not one the console may import" in item["tokenizer"]["note"]
    c.drop_table("sneaky")


def test_a_hugging_face_tokenizer_directory(loaded, tmp_path):
    tokenizers_lib = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    raw = tokenizers_lib.Tokenizer(tokenizers_lib.models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = tokenizers_lib.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    s, c, _ = loaded
    c.create_table("hf", metadata={"tokenizer": f"hf:{tmp_path / 'tok'}"}, if_not_exists=True)
    c.insert("hf", [{"traj_id": "h", "prompt_id": "p", "task": "t", "tokens": [1, 2, 1], "loss_mask": [0, 1, 1],
                     "logprobs": [0.0, -0.1, -0.2], "policy_version": 0, "finish_reason": "stop"}])
    item_id = c.query_table("SELECT item_id FROM hf").column(0)[0].as_py()
    item = console_for(s.address).get("/api/item", params={"table": "hf", "id": item_id}).json()
    assert item["tokens"]["pieces"] == ["hello", "world", "hello"], item["tokenizer"]
    c.drop_table("hf")


def test_unknown_item_and_table_are_404(loaded):
    s, _, _ = loaded
    http = console_for(s.address)
    r = http.get("/api/item", params={"table": "agent", "id": 10**9})
    assert r.status_code == 404 and "no item with id" in r.json()["error"]
    r = http.get("/api/item", params={"table": "nope", "id": 1})
    assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND"
    r = http.get("/api/item", params={"table": "agent", "id": "x"})
    assert r.status_code == 400 and "must be an integer" in r.json()["error"]


def test_manifest_lists_what_the_step_sampled(loaded):
    s, c, rows = loaded
    m = console_for(s.address).get("/api/manifest", params={"table": "agent", "step": 7}).json()
    ids, versions = c.manifest("agent", 7)
    assert [r["item_id"] for r in m["items"]] == ids.tolist()
    assert [r["policy_version"] for r in m["items"]] == versions.tolist()
    by_traj = {r["traj_id"]: r for r in rows}
    for r in m["items"]:
        assert r["reward"] == by_traj[r["traj_id"]]["reward"] and r["num_generated"] == generated(by_traj[r["traj_id"]])
    r = console_for(s.address).get("/api/manifest", params={"table": "agent", "step": 8})
    assert r.status_code == 404 and "no manifest for step 8" in r.json()["error"]


def test_hacking_views_are_the_rows_figures(loaded):
    s, _, rows = loaded
    d = console_for(s.address).get("/api/hacking", params={"table": "agent"}).json()
    by_v = defaultdict(list)
    for r in rows:
        by_v[r["policy_version"]].append(r)
    versions = sorted(by_v)
    assert d["drift"]["version"] == versions
    assert d["drift"]["reward"] == pytest.approx([statistics.mean(r["reward"] for r in by_v[v]) for v in versions])
    assert d["drift"]["length"] == pytest.approx([statistics.mean(generated(r) for r in by_v[v]) for v in versions])
    assert d["drift"]["correlation"] == pytest.approx(
        [float(np.corrcoef([r["reward"] for r in by_v[v]], [generated(r) for r in by_v[v]])[0, 1]) for v in versions])
    groups = defaultdict(list)
    for r in rows:
        groups[(r["policy_version"], r["group_id"])].append(r["reward"])
    assert d["collapse"]["groups"] == [sum(1 for (v, _) in groups if v == ver) for ver in versions]
    assert d["collapse"]["zero_variance"] == [sum(1 for (v, _), rs in groups.items() if v == ver and max(rs) == min(rs))
                                              for ver in versions]
    comps = defaultdict(list)
    for r in rows:
        for k, x in r["reward_components"].items():
            comps[(r["policy_version"], k)].append(abs(x))
    assert list(zip(d["components"]["version"], d["components"]["component"])) == sorted(comps)
    assert d["components"]["mean_abs"] == pytest.approx([statistics.mean(comps[k]) for k in sorted(comps)])
    finish = Counter((r["policy_version"], r["finish_reason"]) for r in rows)
    assert dict(zip(zip(d["finish"]["version"], d["finish"]["finish_reason"]), d["finish"]["items"])) == finish
    calls = Counter(r["policy_version"] for r in rows)
    errors = Counter(r["policy_version"] for r in rows if r["turns"][1]["tool_status"] != "ok")
    assert d["tools"]["calls"] == [calls[v] for v in versions] and d["tools"]["errors"] == [errors[v] for v in versions]
    assert len(d["scatter"]["item_id"]) == len(rows)
    r = console_for(s.address).get("/api/hacking", params={"table": "nope"})
    assert r.status_code == 404


def test_hacking_views_read_only_the_last_versions(loaded):
    s, c, rows = loaded
    c.set_policy_version("agent", 3)
    d = console_for(s.address).get("/api/hacking", params={"table": "agent", "versions": 2}).json()
    assert d["first_version"] == 2 and d["drift"]["version"] == [2, 3]
    assert hacking.DEFAULT_VERSIONS >= 1


def test_an_audit_runs_and_its_report_links_the_offenders(loaded):
    s, c, rows = loaded
    http = console_for(s.address)
    r = http.post("/api/audit/run", json={"table": "agent", "reward": REWARD, "out": "audits"}, headers=H)
    assert r.status_code == 200, r.text
    run = r.json()
    expected = Counter("ok" if exact_match(r).value == r["reward"] else "mismatch" for r in rows)
    assert (run["ok"], run["mismatch"], run["items"]) == (expected["ok"], expected["mismatch"], len(rows))
    listing = http.get("/api/audits").json()
    assert any(a["audit_id"] == run["audit_id"] and a["mismatch"] == expected["mismatch"] for a in listing["audits"])
    assert listing["rewards"] == [REWARD]
    rep = http.get("/api/audit", params={"results_table": "audits", "audit_id": run["audit_id"]}).json()
    assert rep["mismatch"] == expected["mismatch"] and rep["source_table"] == "agent"
    wrong = {r["traj_id"] for r in rows if exact_match(r).value != r["reward"]}
    assert {o["traj_id"] for o in rep["top_offenders"]} <= wrong and rep["top_offenders"]
    assert [b["policy_version"] for b in rep["by"]["policy_version"]] == [0, 1, 2, 3]
    r = http.post("/api/audit/run", json={"table": "agent", "reward": "os:system"}, headers=H)
    assert r.status_code == 400 and "not one this console runs" in r.json()["error"]


def test_posts_need_the_console_header_and_a_bounded_body(loaded):
    s, _, _ = loaded
    http = console_for(s.address)
    r = http.post("/api/query", json={"sql": "SELECT 1"})
    assert r.status_code == 403 and "X-Expstore-Console".lower() in r.json()["error"].lower()
    r = http.post("/api/query", content=b"x" * (2 << 20), headers=H)
    assert r.status_code == 413


def test_a_loopback_console_refuses_other_host_names(loaded):
    s, _, _ = loaded
    app = create_app(Console(Gateway(s.address), Tokenizers(), Runner(())))
    assert TestClient(app, base_url="http://127.0.0.1:8080").get("/").status_code == 200
    assert TestClient(app, base_url="http://localhost:8080").get("/api/tables").status_code == 200
    r = TestClient(app, base_url="http://attacker.example:8080").get("/api/tables")
    assert r.status_code == 421


AUTH = """
[auth]
tokens = [
  { name = "ops", token = "admin-secret", roles = ["admin"] },
  { name = "viewer", token = "reader-secret", roles = ["reader"] },
  { name = "rollouts", token = "producer-secret", roles = ["producer"] },
]
"""


def test_auth_is_the_stores(server_factory):
    s = server_factory(AUTH)
    with Client(s.address, "admin-secret") as admin:
        admin.create_table("agent", metadata={"tokenizer": TOKENIZER})
        admin.insert("agent", agent_rows()[:8])
    http = console_for(s.address)
    r = http.get("/api/tables")
    assert r.status_code == 401
    assert r.json()["error"] == "UNAUTHENTICATED: missing bearer token: send metadata 'authorization: Bearer <token>'"
    r = http.post("/api/login", json={"token": "wrong"}, headers=H)
    assert r.status_code == 401 and r.json()["error"] == "UNAUTHENTICATED: unknown bearer token"
    assert "expstore_token" not in http.cookies
    r = http.post("/api/login", json={"token": "producer-secret"}, headers=H)
    assert r.status_code == 403 and "needs role 'reader'" in r.json()["error"]
    r = http.post("/api/login", json={"token": "reader-secret"}, headers=H)
    assert r.status_code == 200 and r.json()["tables"] == ["agent"]
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert [t["name"] for t in http.get("/api/tables").json()["tables"]] == ["agent"]
    assert http.post("/api/query", json={"sql": "SELECT count(*) AS n FROM agent"}, headers=H).json()["rows"] == [[8]]
    # a reader may not run an audit: creating its results table needs admin, refused before any work
    r = http.post("/api/audit/run", json={"table": "agent", "reward": REWARD}, headers=H)
    assert r.status_code == 403 and "needs role 'admin'" in r.json()["error"]
    with Client(s.address, "admin-secret") as admin:
        assert [t.name for t in admin.list_tables()] == ["agent"]
    # the Authorization header works too, and wins over the cookie
    r = http.get("/api/tables", headers={"Authorization": "Bearer producer-secret"})
    assert r.status_code == 403
    http.post("/api/logout", headers=H)
    assert http.get("/api/tables").status_code == 401


def test_a_manifest_of_an_archiving_table_still_finds_its_items(server_factory):
    # the RL demo's table: rows leave once sampled (max_times_sampled 1) into the archive
    from ._util import wait_until

    s = server_factory()
    with Client(s.address) as c:
        c.create_table("rl", tiers="remote", archive=True, max_times_sampled=1, metadata={"tokenizer": TOKENIZER})
        rows = agent_rows()[:8]
        c.insert("rl", rows)
        c.sample("rl", 8, step=1)
        http = console_for(s.address)
        assert wait_until(lambda: http.get("/api/manifest", params={"table": "rl", "step": 1}).json()["gone"] == 0,
                          timeout=30)
        m = http.get("/api/manifest", params={"table": "rl", "step": 1}).json()
        assert sorted(r["traj_id"] for r in m["items"]) == sorted(r["traj_id"] for r in rows)
        item = http.get("/api/item", params={"table": "rl", "id": m["items"][0]["item_id"]}).json()
        assert item["facts"]["tier"] == "archive" and item["tokens"]["pieces"]
