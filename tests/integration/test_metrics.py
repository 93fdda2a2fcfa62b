"""Prometheus metrics (``--metrics-port``), the Grafana dashboard over them, and
``expstore stats --watch``, against a real server subprocess."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from expstore_client import Client

from expstore_proto.service import client_stub
from expstore_proto.v1 import expstore_pb2 as pb

from ._util import rpc_error, self_signed, start_server, trajectories, unused_port, wait_until, with_loss_mask

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "expstore.json"
STATS_DOC = ROOT / "docs" / "stats.md"
Samples = dict[tuple[str, frozenset], float]


def scrape_text(port: int, scheme: str = "http", context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/metrics", timeout=10, context=context) as r:
        return r.read().decode()


def samples_of(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def series(samples: Samples, name: str, **labels: str) -> dict[frozenset, float]:
    """Every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return {lab: v for (n, lab), v in samples.items() if n == name and want <= lab}


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    """One server with metrics on; each test uses tables of its own."""
    port = unused_port()
    server = start_server(tmp_path_factory.mktemp("metrics") / "data", None, "--metrics-port", str(port))
    client = Client(server.address)
    yield server, client, port
    client.close()
    server.stop()


def test_rpc_counters_are_exact(metered):
    server, c, port = metered
    c.create_table("rpc")
    c.insert("rpc", trajectories(10, tokens=16))
    bad = with_loss_mask(trajectories(3, tokens=16, id_prefix="bad"), 1, 9, 2)
    rpc_error(lambda: c.insert("rpc", bad), grpc.StatusCode.INVALID_ARGUMENT)
    rpc_error(lambda: c.stats("no-such-table"), grpc.StatusCode.NOT_FOUND)
    s = samples_of(scrape_text(port))
    assert value(s, "expstore_rpc_requests_total", method="Insert", table="rpc") == 2
    assert series(s, "expstore_rpc_errors_total", method="Insert", table="rpc") == {
        frozenset({"method": "Insert", "table": "rpc", "code": "INVALID_ARGUMENT"}.items()): 1}
    assert value(s, "expstore_rpc_duration_seconds_count", method="Insert", table="rpc") == 2
    assert value(s, "expstore_rpc_requests_total", method="CreateTable", table="rpc") == 1
    assert series(s, "expstore_rpc_errors_total", method="CreateTable") == {}
    # an unknown table is never a label value: cardinality stays bounded
    assert value(s, "expstore_rpc_errors_total", method="Stats", table="", code="NOT_FOUND") == 1
    assert not any(("table", "no-such-table") in labels for _, labels in s)
    assert value(s, "expstore_rpc_received_bytes_total", method="Insert", table="rpc") > 10 * 16 * 9  # tokens etc.
    assert value(s, "expstore_rpc_sent_bytes_total", method="Insert", table="rpc") > 0
    assert value(s, "expstore_inserted_items_total", table="rpc") == 10


def test_a_stream_cancelled_mid_way_counts_as_cancelled(metered):
    server, c, port = metered
    c.create_table("big")
    c.insert("big", trajectories(64, tokens=4096))  # 1 MB of tokens; x200 below: far more than flow control lets through
    with grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        call = client_stub(channel).Query(pb.QueryRequest(sql="SELECT tokens FROM big, range(200)"))
        next(call)
        call.cancel()
    errors = lambda: series(samples_of(scrape_text(port)), "expstore_rpc_errors_total", method="Query")
    assert wait_until(lambda: errors() != {})
    assert errors() == {frozenset({"method": "Query", "table": "", "code": "CANCELLED"}.items()): 1}


def test_table_figures_equal_stats(metered):
    server, c, port = metered
    c.create_table("tiers")
    c.insert("tiers", trajectories(7, tokens=16))
    stats = c.stats("tiers")["tiers"]
    s = samples_of(scrape_text(port))
    for tier in ("memory", "ssd", "remote"):
        assert value(s, "expstore_items", table="tiers", tier=tier) == stats[f"items_{tier}"]
    assert sum(series(s, "expstore_items", table="tiers").values()) == 7
    assert value(s, "expstore_tier_bytes", table="tiers", tier="memory") == stats["memory_bytes"]
    assert value(s, "expstore_tier_bytes", table="tiers", tier="ssd") == stats["ssd_bytes"] > 0
    assert ("expstore_tier_bytes", frozenset({"table": "tiers", "tier": "remote"}.items())) not in s  # no remote tier
    assert value(s, "expstore_tier_budget_bytes", table="tiers", tier="memory") == stats["memory_budget_bytes"]


def test_staleness_histogram_and_stream_groups(metered):
    server, c, port = metered
    c.create_table("stale", sampler="fifo", max_times_sampled=1)  # a queue: each item once, oldest first
    c.insert("stale", trajectories(4, tokens=16, policy_version=0, id_prefix="v0"))
    c.insert("stale", trajectories(4, tokens=16, policy_version=2, id_prefix="v2"))
    c.set_policy_version("stale", 3)
    batch = c.sample("stale", 6)  # four 3 versions behind, two 1 behind
    assert sorted(batch.policy_versions.tolist()) == [0, 0, 0, 0, 2, 2]
    c.create_table("groups")
    c.insert("groups", trajectories(5, tokens=16))
    delivered = next(c.stream("groups", "trainer", 3))
    s = samples_of(scrape_text(port))
    buckets = {dict(lab)["le"]: v for lab, v in
               series(s, "expstore_staleness_versions_bucket", table="stale", op="sample").items()}
    assert buckets == {"0.0": 0, "1.0": 2, "2.0": 2, "4.0": 6, "8.0": 6, "16.0": 6, "32.0": 6, "64.0": 6, "+Inf": 6}
    assert value(s, "expstore_staleness_versions_sum", table="stale", op="sample") == 4 * 3 + 2 * 1
    assert value(s, "expstore_staleness_versions_count", table="stale", op="sample") == 6
    assert value(s, "expstore_staleness_versions_count", table="stale", op="stream") == 0
    assert value(s, "expstore_removed_items_total", table="stale", reason="max_times_sampled") == 6
    assert value(s, "expstore_policy_version", table="stale") == 3
    assert value(s, "expstore_stream_lag_items", table="groups", group="trainer") == 2
    assert value(s, "expstore_stream_unacked_items", table="groups", group="trainer") == 3
    delivered.ack()
    s = samples_of(scrape_text(port))
    assert value(s, "expstore_stream_unacked_items", table="groups", group="trainer") == 0
    assert value(s, "expstore_stream_acked_items_total", table="groups", group="trainer") == 3
    assert value(s, "expstore_staleness_versions_bucket", table="groups", op="stream", le="0.0") == 3


def workload(c: Client, table: str) -> None:
    """Enough calls that every labelled series of the dashboard exists."""
    c.create_table(table, rate_limiter={"type": "min_size", "min_size_to_sample": 2})
    c.insert(table, trajectories(4, tokens=16))
    c.sample(table, 2)
    next(c.stream(table, "dash", 2)).ack()
    c.set_policy_version(table, 1)


def test_every_dashboard_metric_is_in_a_scrape(metered):
    server, c, port = metered
    workload(c, "dash")
    scraped = {name for name, _ in samples_of(scrape_text(port))}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert exprs and all("$table" in e for e in exprs)
    used = {n for e in exprs + [variables["table"]["definition"]] for n in re.findall(r"\bexpstore_\w+", e)}
    assert used - scraped == set()
    assert {"expstore_rpc_duration_seconds_bucket", "expstore_staleness_versions_bucket",
            "expstore_stream_lag_items", "expstore_items"} <= used


def test_every_exported_metric_is_documented(metered):
    server, c, port = metered
    workload(c, "docs")
    exported = {f.name + ("_total" if f.type == "counter" else "")
                for f in text_string_to_metric_families(scrape_text(port)) if not f.name.endswith("_created")}
    section = STATS_DOC.read_text().split("## Prometheus metrics", 1)[1]
    documented = set(re.findall(r"^\| `(expstore_\w+)` \|", section, re.M))
    assert exported == documented


def test_stats_watch_prints_successive_blocks(metered):
    server, c, port = metered
    c.create_table("watched")
    c.insert("watched", trajectories(3, tokens=16))
    p = subprocess.run([sys.executable, "-m", "expstore_server.cli", "--server", server.address, "stats", "watched",
                        "--watch", "--count", "2", "--interval", "0.2"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "EXPSTORE_SERVER": "127.0.0.1:1"})
    assert p.returncode == 0, p.stderr
    blocks = p.stdout.split("\n\n")
    assert len(blocks) == 2 and "\033[" not in p.stdout  # no terminal: no redraw
    for block in blocks:
        assert block.startswith("expstore stats") and "watched  items 3  eligible 3" in block
        assert re.search(r"items\s+3\s+0\s+0", block)
    assert "inserted -" in blocks[0] and "inserted 0.0" in blocks[1]


def test_config_key_with_tls_and_a_taken_port(server_factory, tmp_path):
    cert, key = self_signed(tmp_path)
    port = unused_port()
    s = server_factory(f'[server]\nmetrics_port = {port}\n[tls]\ncert = "{cert}"\nkey = "{key}"\n')
    with Client(s.address, tls=cert) as c:
        c.create_table("t")
    text = scrape_text(port, "https", ssl.create_default_context(cafile=str(cert)))
    assert value(samples_of(text), "expstore_rpc_requests_total", method="CreateTable", table="t") == 1
    with pytest.raises(RuntimeError, match=f"cannot bind metrics on 127.0.0.1:{port}"):
        server_factory(None, "--metrics-port", str(port))
