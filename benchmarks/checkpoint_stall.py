"""How long a checkpoint makes other RPCs wait: worst insert and describe latency against
a real server, with and without a concurrent ``Checkpoint``, in the same run.

One expstore server on 127.0.0.1 (a fresh data dir, its default file:// remote tier), one
``tiers = "ssd"`` table. Each round first fills the RocksDB memtable (inserts of 256 x
~36 KiB trajectories, about 40 MB stored: what a checkpoint must flush), then runs two
probes for ``WINDOW`` seconds, each one call at a time on its own channel: small inserts
(8 rows of 64 tokens) and ``DescribeTable``. A second into the window a ``Checkpoint`` is
taken in checkpoint rounds; baseline rounds take none. Rounds alternate. The figure is
each probe's worst latency in the window (median and max over rounds), and the extra
wait a checkpoint adds: worst-with minus worst-without.

``python -m benchmarks.checkpoint_stall [--rounds N]`` prints its table on stderr and its
JSON on the last stdout line. On a shared 2-core machine latencies are noisy; compare
the two columns of the same run, not runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from expstore.synthetic import trajectories
from expstore_client import Client

from . import server
from .report import _f, _table

WINDOW = 3.0          # seconds each probe runs per round
CHECKPOINT_AT = 1.0   # seconds into the window
FILL = 8              # inserts of 256 x 4096 tokens before each round (~40 MB stored)


def _probe(call, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)


def one_round(address: str, table: str, checkpoint: str | None, seed: int, fill: int = FILL) -> dict:
    filler = Client(address)
    for i in range(fill):
        filler.insert(table, trajectories(256, tokens=4096, seed=seed * 100 + i, id_prefix=f"f{seed}-{i}"))
    inserter, describer, admin = Client(address), Client(address), Client(address)
    n = iter(range(10**9))
    calls = {"insert": lambda: inserter.insert(table, trajectories(8, tokens=64, seed=next(n),
                                                                   id_prefix=f"p{seed}-{next(n)}")),
             "describe": lambda: describer.describe(table)}
    stop, latencies = threading.Event(), {k: [] for k in calls}
    threads = [threading.Thread(target=_probe, args=(call, stop, latencies[k])) for k, call in calls.items()]
    for t in threads:
        t.start()
    time.sleep(CHECKPOINT_AT)
    took = None
    if checkpoint is not None:
        took = admin.checkpoint(checkpoint)["seconds"]
    time.sleep(max(0.0, WINDOW - CHECKPOINT_AT - (took or 0.0)))
    stop.set()
    for t in threads:
        t.join()
    for c in (filler, inserter, describer, admin):
        c.close()
    return {"checkpoint_s": took, **{f"{k}_worst_ms": 1000 * max(v) for k, v in latencies.items()},
            **{f"{k}_p50_ms": 1000 * statistics.median(v) for k, v in latencies.items()},
            **{f"{k}_calls": len(v) for k, v in latencies.items()}}


def run(rounds: int, fill: int = FILL) -> dict:
    with server.start_expstore() as s:
        c = Client(s.address)
        c.create_table("stall", tiers="ssd", max_size=10**7)
        out = {"baseline": [], "checkpoint": []}
        for r in range(rounds):
            for kind in ("baseline", "checkpoint"):
                out[kind].append(one_round(s.address, "stall", f"stall-{r}" if kind == "checkpoint" else None,
                                           2 * r + (kind == "checkpoint"), fill))
        c.close()
    summary = {}
    for probe in ("insert", "describe"):
        without, with_ = ([x[f"{probe}_worst_ms"] for x in out[k]] for k in ("baseline", "checkpoint"))
        summary[probe] = {"baseline_worst_ms_median": statistics.median(without),
                          "baseline_worst_ms_max": max(without),
                          "checkpoint_worst_ms_median": statistics.median(with_),
                          "checkpoint_worst_ms_max": max(with_),
                          "extra_ms_median": statistics.median(with_) - statistics.median(without)}
    summary["checkpoint_s_median"] = statistics.median(x["checkpoint_s"] for x in out["checkpoint"])
    return {"rounds": out, "summary": summary}


def render(result: dict) -> str:
    s = result["summary"]
    rows = [[probe, _f(s[probe]["baseline_worst_ms_median"], 1), _f(s[probe]["baseline_worst_ms_max"], 1),
             _f(s[probe]["checkpoint_worst_ms_median"], 1), _f(s[probe]["checkpoint_worst_ms_max"], 1),
             _f(s[probe]["extra_ms_median"], 1)] for probe in ("insert", "describe")]
    return (f"checkpoint stall ({len(result['rounds']['baseline'])} rounds each; a checkpoint took "
            f"{s['checkpoint_s_median']:.2f} s, median)\n"
            + _table(["probe", "worst ms, no ckpt (median)", "(max)", "worst ms, ckpt (median)", "(max)",
                      "extra ms"], rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks.checkpoint_stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fill", type=int, default=FILL, help="inserts of 256 x 4096 tokens before each round")
    args = p.parse_args(argv)
    result = run(args.rounds, args.fill)
    print(render(result), file=sys.stderr)
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
