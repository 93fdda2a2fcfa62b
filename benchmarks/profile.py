"""cProfile of the insert and sample paths, client and server side (not part of ``run``).

``python -m benchmarks.profile [--seconds 5] [--tokens 4096] [insert] [sample] [concurrent]``

The server runs under a wrapper (``--serve``): the event-loop thread, every
ThreadPoolExecutor work item (the engine threads) and every Arrow Flight handler (the
default client sends large inserts and samples over Flight, on Flight's own threads) get
their own cProfile profilers,
switched on by SIGUSR1 and off by SIGUSR2, so table set-up is not in the profile; the
stats are written when the server exits. The client loop (one sync Client, batches of
256 rows of ``--tokens`` tokens, 4096: ~36 KiB; or 1,000 async producers for ``concurrent``) is profiled in this process.
Prints the top functions by cumulative and by own time for each side.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import os
import pstats
import signal
import sys
import threading
import time

TOP = 10
_PARTS = {"loop": "event-loop thread", "workers": "engine and Flight threads"}


def _serve(out: str, argv: list[str]) -> int:
    import concurrent.futures.thread as cft

    from expstore_server import main as server_main
    from expstore_server.flight import FlightService

    state = {"on": False}
    loop_profiler = cProfile.Profile()
    worker_profilers: list[cProfile.Profile] = []
    local = threading.local()

    def profiled(handler):
        """``handler`` under its thread's profiler while profiling is on: the engine's
        work items, and the Arrow Flight handlers, which run on Flight's own threads."""
        def run(*args, **kwargs):
            if not state["on"]:
                return handler(*args, **kwargs)
            p = getattr(local, "profiler", None)
            if p is None:
                p = local.profiler = cProfile.Profile()
                worker_profilers.append(p)
            p.enable()
            try:
                return handler(*args, **kwargs)
            finally:
                p.disable()
        return run

    def toggle(signum, frame):
        state["on"] = signum == signal.SIGUSR1
        loop_profiler.enable() if state["on"] else loop_profiler.disable()

    cft._WorkItem.run = profiled(cft._WorkItem.run)
    for name in ("do_put", "do_get"):
        setattr(FlightService, name, profiled(getattr(FlightService, name)))
    signal.signal(signal.SIGUSR1, toggle)
    signal.signal(signal.SIGUSR2, toggle)
    rc = server_main.main(argv)
    loop_profiler.dump_stats(out + ".loop")
    if worker_profilers:
        stats = pstats.Stats(worker_profilers[0])
        for p in worker_profilers[1:]:
            stats.add(p)
        stats.dump_stats(out + ".workers")
    return rc


def _top(stats: pstats.Stats, title: str) -> str:
    lines = [f"== {title}"]
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        stats.stream = buf
        stats.sort_stats(key).print_stats(TOP)
        body = buf.getvalue()
        lines.append(f"-- top {TOP} by {key}\n" + body[body.index("   ncalls"):].rstrip())
    return "\n".join(lines)


def profile(what: str, seconds: float, tokens: int = 4096) -> str:
    import tempfile

    from expstore.synthetic import trajectories
    from expstore_client import Client

    from . import server
    from .concurrency import _producers
    from .wire import BATCH, relabel

    tmp = tempfile.mkdtemp(prefix="expstore-prof-")
    out = os.path.join(tmp, "server")
    srv = server.start([sys.executable, "-m", "benchmarks.profile", "--serve", out, "--", "--port", "0",
                        "--data-dir", os.path.join(tmp, "data"), "--log-level", "warning"],
                       server.EXPSTORE_BANNER)
    client = Client(srv.address)
    data = trajectories(BATCH, tokens=tokens)
    max_size = 8192 if tokens >= 1024 else 200_000
    client.create_table("p", sampler="uniform", max_size=max_size, memory_bytes=16 << 30)
    for i in range(max_size // BATCH + 8):
        client.insert("p", relabel(data, f"fill{i}"))
    client_profiler = cProfile.Profile()
    calls = 0
    os.kill(srv.pid, signal.SIGUSR1)
    time.sleep(0.2)
    start = time.perf_counter()
    client_profiler.enable()
    if what == "concurrent":
        asyncio.run(_producers(srv.address, producers=1000, channels=8, calls=2, rows=8))
        calls = 2000
    else:
        while time.perf_counter() - start < seconds:
            if what == "insert":
                client.insert("p", relabel(data, f"i{calls}"))
            else:
                client.sample("p", BATCH)
            calls += 1
    client_profiler.disable()
    wall = time.perf_counter() - start
    os.kill(srv.pid, signal.SIGUSR2)
    client.close()
    srv.stop()
    report = [f"##### {what} (tokens={tokens}): {calls} calls in {wall:.2f} s ({calls / wall:.1f} calls/s)",
              _top(pstats.Stats(client_profiler), f"{what}: client")]
    for part in ("loop", "workers"):
        if os.path.exists(f"{out}.{part}"):
            report.append(_top(pstats.Stats(f"{out}.{part}"), f"{what}: server {_PARTS[part]}"))
    return "\n\n".join(report)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--serve":
        return _serve(argv[1], argv[3:])
    seconds = float(argv[argv.index("--seconds") + 1]) if "--seconds" in argv else 5.0
    tokens = int(argv[argv.index("--tokens") + 1]) if "--tokens" in argv else 4096
    whats = [a for a in argv if a in ("insert", "sample", "concurrent")] or ["insert", "sample"]
    for what in whats:
        print(profile(what, seconds, tokens), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
