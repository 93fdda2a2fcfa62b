"""Insert and sample throughput of a server with its web console, polled by browsers or not.

``python -m benchmarks.console [--seconds 20] [--rounds 2] [--browsers 2]``

Starts ``expstore-server --http-port`` (the console as its child), fills a table, then
alternates phases of the same length: a producer thread inserting 64 rows of 512 tokens
per call and a trainer thread sampling 64, with no browser, then with ``--browsers``
HTTP pollers doing what an open console does (``--pages``: the Tables page refreshes
every 2 s, the Reward-hacking page every 30 s; the other pages do not refresh). Prints
JSON: items per second inserted and sampled in each phase, and the console requests made.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from expstore.synthetic import trajectories
from expstore_client import Client

ROWS, TOKENS = 64, 512
PAGES = {"tables": (2.0, "/api/tables"), "hacking": (30.0, "/api/hacking?table=rollouts")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phase(address: str, seconds: float, url: str | None, browsers: int, offset: int, pages: list[str]) -> dict:
    stop = threading.Event()
    counts = {"inserted": 0, "sampled": 0, "requests": 0}
    data = [trajectories(ROWS, tokens=TOKENS, seed=k, id_prefix=f"p{offset}-{k}") for k in range(8)]

    def produce() -> None:
        with Client(address) as c:
            k = 0
            while not stop.is_set():
                t = data[k % len(data)]
                t = t.set_column(0, "traj_id", [[f"{offset}-{k}-{i}" for i in range(ROWS)]])
                counts["inserted"] += c.insert("rollouts", t).num_inserted
                k += 1

    def train() -> None:
        with Client(address) as c:
            while not stop.is_set():
                counts["sampled"] += len(c.sample("rollouts", ROWS))

    def browse() -> None:
        polled = [PAGES[p] for p in pages]
        due = [0.0] * len(polled)
        while not stop.is_set():
            now = time.monotonic()
            for i, (every, path) in enumerate(polled):
                if now >= due[i]:
                    with urllib.request.urlopen(url + path, timeout=60) as r:
                        r.read()
                    counts["requests"] += 1
                    due[i] = now + every
            stop.wait(0.2)

    threads = [threading.Thread(target=produce), threading.Thread(target=train)]
    if url:
        threads += [threading.Thread(target=browse) for _ in range(browsers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    return {"browsers": browsers if url else 0, "seconds": round(elapsed, 2),
            "inserted_per_s": round(counts["inserted"] / elapsed, 1),
            "sampled_per_s": round(counts["sampled"] / elapsed, 1), "console_requests": counts["requests"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--browsers", type=int, default=2)
    p.add_argument("--pages", default="tables,hacking", help=f"pages the browsers keep open, of {', '.join(PAGES)}")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "expstore_server.main", "--port", "0", "--data-dir", str(Path(tmp) / "d"),
               "--http-port", str(free_port())]
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            address = server.stdout.readline().rsplit(" ", 1)[1].strip()
            url = server.stdout.readline().rsplit(" ", 1)[1].strip()
            with Client(address) as c:
                c.create_table("rollouts", max_size=20_000)
                for k in range(8):
                    c.insert("rollouts", trajectories(256, tokens=TOKENS, seed=k, id_prefix=f"fill{k}"))
            results = []
            for r in range(a.rounds):
                results.append(phase(address, a.seconds, None, 0, 2 * r, []))
                results.append(phase(address, a.seconds, url, a.browsers, 2 * r + 1, a.pages.split(",")))
            print(json.dumps({"rows_per_call": ROWS, "tokens": TOKENS, "phases": results}, indent=1))
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
