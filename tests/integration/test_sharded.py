"""ShardedClient over three real servers: placement, sampling over the union (chi-square
against the single-table distribution), fan-out and merges, and a shard killed and
restarted on its data dir while the others keep serving."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import textwrap
import threading

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import stats as sps

from expstore_client import ShardedClient, ShardedInsertError
from expstore_client._placement import place
from expstore_client._shard_ids import decode

from ._util import restartable_port, rpc_error, start_server, trajectories, wait_until

P_MIN = 1e-3  # a correct sampler fails a chi-square test this rarely


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three servers on loopback, started concurrently (the last test restarts one)."""
    root = tmp_path_factory.mktemp("shards")
    started: list = [None] * 3

    def start(i: int) -> None:
        started[i] = start_server(root / f"data{i}", None, *(("--port", restartable_port()) if i == 1 else ()))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(started), "a server did not start"
    yield started
    for s in started:
        s.stop(signal.SIGKILL)


@pytest.fixture
def client(servers):
    c = ShardedClient([s.address for s in servers], stats_ttl_s=0.0, reconnect_backoff_s=0.3, seed=1)
    yield c
    c.close()


@pytest.fixture
def table(client, request):
    name = "t_" + request.node.name.replace("[", "_").replace("]", "")
    yield name
    try:
        client.drop_table(name)
    except grpc.RpcError:
        pass


def uneven_rows(client: ShardedClient, sizes: tuple[int, ...], prefix: str) -> pa.Table:
    """Trajectories whose traj_ids place ``sizes[k]`` rows on shard k (an uneven union
    exposes a split that is not proportional)."""
    candidates = pa.array([f"{prefix}-{i}" for i in range(40 * sum(sizes))])
    shard = place(candidates, client.shards)
    chosen = np.concatenate([np.flatnonzero(shard == k)[:n] for k, n in enumerate(sizes)])
    rows = trajectories(len(chosen), tokens=16, id_prefix=prefix)
    return rows.set_column(0, "traj_id", candidates.take(pa.array(chosen)))


def shard_of(batch) -> np.ndarray:
    return decode(batch.ids)[0]


# -- sampling over the union -----------------------------------------------------------

def test_uniform_sampling_is_uniform_over_the_union(client, table):
    client.create_table(table)
    rows = uneven_rows(client, (6, 18, 36), "u")
    client.insert(table, rows)
    counts: dict[str, int] = {}
    batches = client.sampler(table, 200, prefetch=2)
    for batch in itertools.islice(batches, 20):
        assert np.allclose(batch.probabilities, 1 / 60) and np.all(batch.weights == 1)
        for traj in batch.column("traj_id").to_pylist():
            counts[traj] = counts.get(traj, 0) + 1
    batches.close()
    observed = np.array([counts.get(t, 0) for t in rows.column("traj_id").to_pylist()])
    p = sps.chisquare(observed).pvalue  # 4000 draws, 60 items: uniform expects 66.7 each
    print(f"uniform over the union: chi-square p = {p:.3f}")
    assert p > P_MIN
    by_shard = [observed[:6].sum(), observed[6:24].sum(), observed[24:].sum()]
    assert sps.chisquare(by_shard, np.array([6, 18, 36]) / 60 * 4000).pvalue > P_MIN


def test_prioritized_frequencies_and_weights_match_one_table(client, table):
    alpha, beta = 0.8, 0.6
    client.create_table(table, sampler={"type": "prioritized", "alpha": alpha, "beta": beta})
    rows = uneven_rows(client, (30, 10, 20), "p")
    priority = np.random.default_rng(3).uniform(0.5, 5.0, rows.num_rows)
    client.insert(table, rows, priorities=priority)
    of = dict(zip(rows.column("traj_id").to_pylist(), priority))
    theory = priority ** alpha / (priority ** alpha).sum()  # one table over the union
    counts: dict[str, int] = {}
    for _ in range(20):
        batch = client.sample(table, 200)
        trajs = batch.column("traj_id").to_pylist()
        p = np.array([of[t] for t in trajs]) ** alpha / (priority ** alpha).sum()
        assert np.allclose(batch.probabilities, p, rtol=1e-9)
        n = len(priority)  # (N P)^-beta / max over the batch, as the single table computes it
        assert np.allclose(batch.weights, (n * p) ** -beta / ((n * p) ** -beta).max(), rtol=1e-9)
        for t in trajs:
            counts[t] = counts.get(t, 0) + 1
    observed = np.array([counts.get(t, 0) for t in rows.column("traj_id").to_pylist()])
    p = sps.chisquare(observed, theory * observed.sum()).pvalue
    print(f"prioritized over the union: chi-square p = {p:.3f}")
    assert p > P_MIN


def test_a_group_never_splits_and_groups_sample_uniformly(client, table):
    client.create_table(table, sampler={"type": "group", "group_size": 4})
    rows = trajectories(160, tokens=16, groups=40, id_prefix="grp")
    shuffled = rows.take(pa.array(np.random.default_rng(4).permutation(160)))
    for part in range(4):  # a group's members arrive in different inserts, as from several producers
        client.insert(table, shuffled.slice(40 * part, 40))
    per_shard = client.query_table(f"SELECT group_id, count(*) AS n FROM {table} GROUP BY group_id")
    assert per_shard.num_rows == 40 and set(per_shard.column("n").to_pylist()) == {4}  # each group on one shard
    assert len(set(per_shard.column("shard").to_pylist())) == 3
    counts: dict[str, int] = {}
    for _ in range(150):
        batch = client.sample(table, 32)
        groups = np.array(batch.column("group_id").to_pylist())
        assert len(set(groups)) == 8  # distinct, whole groups
        for g in set(groups):
            members = np.flatnonzero(groups == g)
            assert len(members) == 4 and np.all(np.diff(members) == 1) and len(set(shard_of(batch)[members])) == 1
            counts[g] = counts.get(g, 0) + 1
        assert np.allclose(batch.probabilities, 1 / 40)
    observed = np.array([counts.get(f"grp-g{g}", 0) for g in range(40)])
    p = sps.chisquare(observed).pvalue
    print(f"groups over the union: chi-square p = {p:.3f}")
    assert p > P_MIN
    with pytest.raises(ValueError, match="multiple of group_size"):
        client.sample(table, 6)


def test_samplers_with_a_global_order_are_refused_but_stream(client, table):
    client.create_table(table, sampler="fifo")
    client.insert(table, trajectories(30, tokens=16, id_prefix="f"))
    with pytest.raises(ValueError, match="'fifo' sampler orders items across the whole table"):
        client.sample(table, 4)
    seen = []
    for batch in client.stream(table, "g", 8, idle_timeout=0.5):
        assert len(batch) <= 8
        seen += batch.column("traj_id").to_pylist()
        batch.ack()
    assert sorted(seen) == sorted(f"f-{i}" for i in range(30))
    assert client.stats(table)[table]["group.g.acked"] == 30
    assert list(client.stream(table, "g", 8, idle_timeout=0.3)) == []  # acked on the shard that delivered


def test_an_auto_acked_stream_acks_each_shards_rows_even_when_the_next_round_reads_elsewhere(client, table):
    """Batches of one row: each round asks one shard for it, so the shard that delivered
    the last row is sent an Ack instead of a Stream call. Every row read is acked once."""
    client.create_table(table, sampler="fifo")
    client.insert(table, uneven_rows(client, (10, 10, 10), "u"))
    stream = client.stream(table, "g", 1, poll_timeout=1, auto_ack=True)
    seen = [next(stream).ids[0] for _ in range(12)]
    assert client.stats(table)[table]["group.g.acked"] == 11  # the last one is acked at close
    stream.close()
    stats = client.stats(table)[table]
    assert len(set(seen)) == 12 and stats["group.g.acked"] == 12 and stats["group.g.inflight"] == 0


def test_training_cuts_resume_every_shard(client, table):
    client.create_table(table)
    client.insert(table, trajectories(30, tokens=16, id_prefix="c"))
    stream = client.stream(table, "trainer", 10, idle_timeout=0.5)
    first = next(stream)
    assert client.commit_cut(table, "trainer", 1, first.ids) == len(first)
    rest = []
    for batch in stream:
        rest += batch.column("traj_id").to_pylist()
        batch.ack()
    assert sorted(rest + first.column("traj_id").to_pylist()) == sorted(f"c-{i}" for i in range(30))
    positions = client.resume(table, "trainer", 1)
    assert set(positions) == set(client.shards) and all(p["inflight"] == 0 for p in positions.values())
    again = [t for b in client.stream(table, "trainer", 10, idle_timeout=0.5) for t in b.column("traj_id").to_pylist()]
    assert sorted(again) == sorted(rest)  # everything after the cut, on every shard


# -- ids, routing, fan-out ---------------------------------------------------------------

def test_sharded_ids_route_get_update_priorities_and_manifest(client, table):
    client.create_table(table, sampler={"type": "prioritized", "alpha": 1.0})
    rows = trajectories(40, tokens=16, id_prefix="r")
    res = client.insert(table, rows)
    assert res.num_inserted == 40 and len(set(res.item_ids.tolist())) == 40
    assert client.insert(table, rows).num_duplicates == 40  # a retry is idempotent across shards
    pick = res.item_ids[[5, 0, 33, 12]]
    got = client.get(table, pick)
    assert got.ids.tolist() == pick.tolist()
    assert got.column("traj_id").to_pylist() == ["r-5", "r-0", "r-33", "r-12"]
    gone = int(pick[1]) + 10**6  # a sharded id on a real shard, with a local id never assigned
    done = client.update_priorities(table, [*pick, gone], [7.0, 8.0, 9.0, 10.0, 11.0])
    assert done.num_updated == 4 and done.unknown_item_ids.tolist() == [gone]
    stored = client.query_table(f"SELECT traj_id, priority FROM {table} WHERE priority > 1")
    assert dict(zip(stored.column("traj_id").to_pylist(), stored.column("priority").to_pylist())) == \
        {"r-5": 7.0, "r-0": 8.0, "r-33": 9.0, "r-12": 10.0}
    back = np.concatenate([client.item_ids(shard, ids) for shard, ids in client.split_ids(pick).items()])
    assert sorted(back.tolist()) == sorted(pick.tolist())
    batch = client.sample(table, 64, step=7)
    ids, versions = client.manifest(table, 7)
    assert sorted(ids.tolist()) == sorted(batch.ids.tolist()) and len(versions) == 64
    with pytest.raises(ValueError, match="not an id of this sharded client"):
        client.get(table, [5 << 48 | 1])


def test_stats_and_query_merge(client, table):
    client.create_table(table)
    rows = trajectories(90, tokens=16, tasks=("math", "code", "chat"), id_prefix="s")
    client.insert(table, rows)
    merged = client.stats(table)[table]
    per_shard = client.stats(table, per_shard=True)
    assert merged["items"] == 90 == sum(s[table]["items"] for s in per_shard.values())
    assert merged["shards_up"] == 3 and merged["shards_down"] == 0
    assert merged["inserts"] == 90
    assert client.set_policy_version(table, 4) == 0
    assert client.stats(table)[table]["policy_version"] == 4 and client.describe(table).policy_version == 4
    assert [t.num_items for t in client.list_tables() if t.name == table] == [90]
    rows_by_shard = client.query_table(f"SELECT task, count(*) AS n FROM {table} GROUP BY task")
    assert set(rows_by_shard.column("shard").to_pylist()) == set(client.shards)
    totals = client.query_table(f"SELECT task, count(*) AS n FROM {table} GROUP BY task",
                                merge="SELECT task, CAST(sum(n) AS BIGINT) AS n FROM results GROUP BY task ORDER BY task")
    assert totals.to_pylist() == [{"task": "chat", "n": 30}, {"task": "code", "n": 30}, {"task": "math", "n": 30}]
    assert client.query_table(f"SELECT traj_id FROM {table}", max_rows=10).num_rows == 10
    err = rpc_error(lambda: client.query_table("SELECT * FROM no_such_table"), grpc.StatusCode.INVALID_ARGUMENT)
    assert all(s in err.details() for s in client.shards)


def test_audit_fans_out_into_one_report(client, table, tmp_path, monkeypatch):
    (tmp_path / "sharded_rewards.py").write_text(textwrap.dedent("""
        def stored(row):
            return row["reward"] + (1.0 if row["traj_id"] in ("a-3", "a-7") else 0.0)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    client.create_table(table)
    client.insert(table, trajectories(12, tokens=16, id_prefix="a"))
    report = client.audit(table, "sharded_rewards:stored", workers=1)
    results = report.results
    assert results.num_rows == 12 and report.counts()["mismatch"] == 2 and report.counts()["ok"] == 10
    expected = dict(zip((f"a-{i}" for i in range(12)), np.array(client.shards)[place(
        pa.array([f"a-{i}" for i in range(12)]), client.shards)]))
    assert dict(zip(results.column("traj_id").to_pylist(), results.column("shard").to_pylist())) == expected
    assert client.audit(table, "sharded_rewards:stored", limit=5, workers=1).results.num_rows == 5


def test_the_cli_takes_a_list_of_shards(client, table):
    client.create_table(table)
    client.insert(table, trajectories(20, tokens=16, id_prefix="cli"))

    def cli(*args: str) -> str:
        p = subprocess.run([sys.executable, "-m", "expstore_server.cli", "--server", ",".join(client.shards), *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout

    rows = [json.loads(line) for line in cli("query", f"SELECT count(*) AS n FROM {table}", "--format", "json").splitlines()]
    assert sorted(r["shard"] for r in rows) == client.shards and sum(r["n"] for r in rows) == 20
    lines = cli("checkpoint", "sharded").splitlines()  # one snapshot per shard
    assert len(lines) == 3 and all(line.startswith(f"shard {s}: checkpoint sharded: ")
                                   for line, s in zip(lines, client.shards))



def test_the_cli_audits_the_union_of_the_shards_as_the_sharded_client_does(client, table, tmp_path, monkeypatch):
    """One selection for ``expstore audit --server a,b,c`` and ``ShardedClient.audit``:
    --limit takes the lowest item ids over all shards (not the first shard's rows), the
    reward function never sees the ``shard`` column, and the results carry it."""
    (tmp_path / "union_rewards.py").write_text(textwrap.dedent("""
        def stored(row):
            assert "shard" not in row, "the reward function saw the shard column"
            return row["reward"]
    """))
    client.create_table(table)
    client.insert(table, uneven_rows(client, (2, 5, 3), "u"))
    out = tmp_path / "results.parquet"
    p = subprocess.run([sys.executable, "-m", "expstore_server.cli", "--server", ",".join(client.shards), "audit",
                        table, "--reward", "union_rewards:stored", "--limit", "4", "--workers", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    by_cli = pq.read_table(out).select(["source_item_id", "shard", "status"]).to_pylist()
    lowest = sorted(((i, s) for s in client.shards
                     for i in client.shard(s).query_table(f"SELECT item_id FROM {table}").column(0).to_pylist()))[:4]
    assert [(r["source_item_id"], r["shard"]) for r in by_cli] == lowest
    assert {r["status"] for r in by_cli} == {"ok"}
    monkeypatch.syspath_prepend(str(tmp_path))
    by_client = client.audit(table, "union_rewards:stored", limit=4, workers=1).results
    assert by_client.select(["source_item_id", "shard"]).to_pylist() == [
        {"source_item_id": i, "shard": s} for i, s in lowest]

# -- a shard down, and back ------------------------------------------------------------

def test_a_killed_shard_fails_its_inserts_fast_and_recovers(servers, client, table):
    client.create_table(table)
    client.insert(table, trajectories(60, tokens=16, id_prefix="k"))
    victim = servers[1]
    name = victim.address
    held = client.shard(name).describe(table).num_items
    assert 0 < held < 60
    victim.stop(signal.SIGKILL)

    rows = trajectories(30, tokens=16, id_prefix="down")
    on_victim = np.flatnonzero(place(rows.column("traj_id"), client.shards) == client.shards.index(name))
    with pytest.raises(ShardedInsertError) as info:
        client.insert(table, rows)
    err = info.value
    assert err.code() == grpc.StatusCode.UNAVAILABLE and f"shard {name} ({len(on_victim)} rows)" in err.details()
    assert list(err.failures) == [name] and err.failed_rows.tolist() == on_victim.tolist()
    assert sum(r.num_inserted for r in err.stored.values()) == 30 - len(on_victim)

    batch = client.sample(table, 100)  # the others keep serving, over their union
    assert client.shards.index(name) not in set(shard_of(batch).tolist())
    assert np.allclose(batch.probabilities, 1 / (90 - len(on_victim) - held))
    merged = client.stats(table)[table]
    assert merged["shards_down"] == 1 and merged["items"] == 90 - len(on_victim) - held

    retrying = ShardedClient(client.shards, insert_retries=200, retry_backoff_s=0.02, max_backoff_s=0.1,
                             reconnect_backoff_s=0.2)
    later = trajectories(30, tokens=16, id_prefix="later")
    pending = retrying.insert_future(table, later)
    assert wait_until(pending.done)  # the first attempt already failed on the dead shard
    port = name.rsplit(":", 1)[1]
    servers[1] = start_server(victim.data_dir, None, "--port", port)  # same data dir, same address
    assert pending.result().num_inserted == 30
    retrying.close()

    assert wait_until(lambda: client.stats(table)[table]["shards_up"] == 3, timeout=15)
    assert client.insert(table, rows).num_duplicates == 30 - len(on_victim)  # the retry stores the rest
    assert client.stats(table)[table]["items"] == 120  # the restarted shard's items are back
    assert set(shard_of(client.sample(table, 100)).tolist()) == {0, 1, 2}
