"""Section 8: what the sharded client costs and gives, against one server in the same run.

Three expstore servers on 127.0.0.1 (fresh processes, memory-tier tables, so the figures
are the client's and the wire's, not RocksDB's). Configurations, each on a fresh table:

- ``Client, 1 server``: the baseline;
- ``ShardedClient, 1 shard``: the same server behind the sharded layer (placement by
  group_id, the union sampler's stats call and split, sharded ids);
- ``ShardedClient, 3 shards``: rows spread over the three servers.

Workload: batches of 256 trajectories of ~36 KiB (``trajectories(256, tokens=4096)``,
32 GRPO groups of 8, fresh traj_ids and group_ids per batch), one call at a time, the
configurations taking turns call by call. Insert; ``sample(256)`` uniform; on a
``group`` table, 32 whole groups. Items/s from the median call, and p50/p99 per call.

On a 2-core machine the three servers, the client and the OS share two cores, so three
shards cannot run three times as fast here; the figure is the sharded layer's overhead
and what parallel parts buy when the servers have cores of their own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from expstore.synthetic import trajectories
from expstore_client import Client, ShardedClient

from . import server
from .report import _f, _table

BATCH, TOKENS, GROUPS = 256, 4096, 32
SAMPLERS = {"uniform": "uniform", "group": {"type": "group", "group_size": BATCH // GROUPS}}


def fresh(data: pa.Table, prefix: str) -> pa.Table:
    """The same rows with new traj_ids and group_ids (one batch = its own groups)."""
    for column in ("traj_id", "group_id"):
        values = pc.binary_join_element_wise(prefix, data.column(column), "-")
        data = data.set_column(data.schema.get_field_index(column), column, values)
    return data


def summary(seconds: list[float]) -> dict:
    """Per-call figures; items/s from the median call (these machines are noisy)."""
    ms = np.array(seconds) * 1e3
    return {"items_per_s": BATCH / float(np.median(seconds)), "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99))}


def alternate(rounds: int, calls: dict[str, Callable[[int], object]]) -> dict[str, dict]:
    """Round r runs ``calls[label](r)`` for every label in turn, so that the machine's
    slow and fast moments fall on every configuration alike."""
    seconds: dict[str, list[float]] = {label: [] for label in calls}
    for r in range(rounds):
        for label, call in calls.items():
            t0 = time.perf_counter()
            call(r)
            seconds[label].append(time.perf_counter() - t0)
    return {label: summary(s) for label, s in seconds.items()}


def run(quick: bool) -> dict:
    rounds = 10 if quick else 60
    data = trajectories(BATCH, tokens=TOKENS, groups=GROUPS)
    servers = [server.start_expstore() for _ in range(3)]
    clients = {}
    try:
        addresses = [s.address for s in servers]
        clients = {"Client, 1 server": Client(addresses[0]),
                   "ShardedClient, 1 shard": ShardedClient(addresses[:1]),
                   "ShardedClient, 3 shards": ShardedClient(addresses)}
        name = {label: f"c{i}" for i, label in enumerate(clients)}
        for label, client in clients.items():
            for kind, sampler in SAMPLERS.items():
                table = f"{name[label]}_{kind}"
                client.create_table(table, sampler=sampler, tiers="memory", max_size=10**7)
                client.insert(table, fresh(data, f"{table}-warm"))
                client.sample(table, BATCH)  # warm: the sharded client's table info and stats
        results = {label: {} for label in clients}
        inserts = alternate(rounds, {label: lambda r, c=c, t=f"{name[label]}_uniform": c.insert(t, fresh(data, f"{t}-{r}"))
                                     for label, c in clients.items()})
        for kind in SAMPLERS:
            samples = alternate(rounds, {label: lambda r, c=c, t=f"{name[label]}_{kind}": c.sample(t, BATCH)
                                         for label, c in clients.items()})
            for label in clients:
                results[label][kind] = {"sample": samples[label]}
        for label in clients:
            results[label]["insert"] = inserts[label]
    finally:
        for client in clients.values():
            client.close()
        for s in servers:
            s.stop()
    return {"quick": quick, "rounds": rounds, "rows_per_batch": BATCH,
            "row_bytes": data.nbytes / BATCH, "configs": results}


def render(s: dict) -> str:
    configs = s["configs"]
    base = configs["Client, 1 server"]
    rows = []
    for label, r in configs.items():
        cells = [label, _f(r["insert"]["items_per_s"]), f"{r['insert']['items_per_s'] / base['insert']['items_per_s']:.0%}"]
        for kind in SAMPLERS:
            x = r[kind]["sample"]
            cells += [_f(x["items_per_s"]), f"{x['items_per_s'] / base[kind]['sample']['items_per_s']:.0%}",
                      _f(x["p50_ms"], 1), _f(x["p99_ms"], 1)]
        rows.append(cells)
    mode = "quick" if s.get("quick") else "full"
    return "\n".join([
        f"8. Sharded client ({mode}; benchmarks/sharding.py): {s['rows_per_batch']} rows x "
        f"{s['row_bytes'] / 1024:.1f} KiB a call, {s['rounds']} calls each, in turns; memory-tier tables on 3 local servers",
        _table(["client", "insert items/s", "vs 1 server", "uniform items/s", "vs 1 server", "p50 ms", "p99 ms",
                "groups items/s", "vs 1 server", "p50 ms", "p99 ms"], rows),
        "   items/s from the median call; ratio: against Client on one server in the same run; the 3 servers share "
        "the machine's cores"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks.sharding", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    out = run(p.parse_args(argv).quick)
    print(render(out), file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
