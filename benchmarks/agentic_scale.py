"""Section 9: one server under 10,000 concurrent simulated agentic environments, and a
100,000-environment projection for a sharded store calibrated on what was measured.

One fresh expstore server (the default durable table: SSD tier, acknowledged at `wal`)
and, in this process, one asyncio event loop holding ``envs`` simulated environments.
Each environment plays episodes of 4-16 turns; a turn is a step whose latency is drawn
from a long tail (log-normal, median 3 s, sigma 1.2, clipped to [1 s, 60 s]; p99 ~45 s)
and then a **multi-turn insert**: one row holding the whole episode so far (a 256-token
prompt plus 128 tokens per turn: tokens, loss_mask, logprobs), so an episode's rows
extend each other (``--extends-check`` creates the table with ``ingest_checks =
["extends"]`` and sets ``episode_id``, so the server verifies it on every insert). Rows
go through the client an asyncio agentic producer uses: one ``AsyncClient`` and its
``InsertBatcher`` (``--path batcher``, ``--linger-ms``, default 50), or one
``AsyncClient.insert`` per turn (``--path insert``, as ``expstore_rl.producer.inserter``
does per group).

Three phases, each with fresh environments on the same server:

- **real time** (time scale 1): the latencies as drawn. The offered load is what 10,000
  such environments ask of a store (about envs / 6 s turns/s).
- **saturation** (time scale ``SATURATE``, 1/20: every latency 20x shorter, so the
  offered load is ~20x): the most this server takes on this machine, and what bounds it:
  CPU seconds of the server process and of the client process per wall second (from
  /proc and ``os.times``), beside the machine's cores, and (when ``py-spy`` is installed)
  where the server's and the client's busy samples are, by function, for that phase.
- **saturation, 5 ms linger**: the same with the batcher's default linger, which sends
  RPCs of a row or two: the server's fixed cost per Insert call (decoding, the engine
  thread hop, the journal write, small-chunk merging) then bounds the rows/s.

Reported per phase: turns/s (= rows/s) and bytes/s of token data (tokens, loss_mask,
logprobs: 9 B a token), against the offered turns/s; rows per Insert RPC; insert latency p50/p99 (from a turn's insert call to its return); errors;
server RSS (peak and at the end); CPU of server and client. Measurements count the
window after a warm-up (a tenth of the phase), so the ramp of first steps is excluded.

**Projection to 100,000 environments** (computed, not measured: this machine has 2
shared cores). Demand: what 100,000 environments ask when the store keeps up (envs /
mean step latency, as offered in the real-time phase) and the bytes per turn measured.
Shards: at 70% of the turns/s one server took in the saturation phase (shown here; when
the server was not what bounded that phase its capacity is higher, so this is an upper
bound), and a floor from the server's CPU per turn with one core per shard at 70%.
Producers: demand x the client's CPU per turn, in event-loop processes at 70% of a core.
The sharded store is ``ShardedClient`` over N servers: a row goes to the shard of its
``group_id`` (else its ``traj_id``), so shards share nothing on the insert path and the
projection scales them linearly (an agentic producer gives an episode's rows one
``group_id`` to keep them on one shard, which the ``extends`` check needs); the client's
own cost of the sharded layer is in benchmarks/sharding.py. Every figure of the
projection is computed from this run's measurements, none is typed in.

``--quick``: 1,000 environments, 30 s + 20 s + 15 s. Full: 10,000 environments, 90 s +
45 s + 30 s (about 3.5 minutes with set-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

import grpc
import numpy as np
import pyarrow as pa

from expstore.schema import TRAJECTORY_V1
from expstore_client import AsyncClient

from . import server
from .report import _f, _table

TABLE = "agentic"
PROMPT_TOKENS, TURN_TOKENS, TURNS = 256, 128, (4, 16)
MEDIAN_S, SIGMA, CLIP_S = 3.0, 1.2, (1.0, 60.0)
SATURATE = 1 / 20  # the saturation phase's time scale
HEADROOM = 0.7  # a shard is planned at 70% of its measured capacity
PROJECTED_ENVS = 100_000


def step_latencies(rng: np.random.Generator, n: int) -> np.ndarray:
    """Step latencies in seconds: log-normal (median 3 s, sigma 1.2) clipped to [1, 60]."""
    return np.clip(rng.lognormal(math.log(MEDIAN_S), SIGMA, n), *CLIP_S)


class Episode:
    """One environment's episode: its tokens are drawn once; turn k's row is the prompt
    and the first k turns (a slice of the same buffers, so rows extend each other)."""

    def __init__(self, rng: np.random.Generator, env: int, number: int, episode_ids: bool) -> None:
        self.turns = int(rng.integers(TURNS[0], TURNS[1] + 1))
        n = PROMPT_TOKENS + self.turns * TURN_TOKENS
        mask = np.ones(n, np.uint8)
        mask[:PROMPT_TOKENS] = 0
        self.values = {"tokens": pa.array(rng.integers(0, 50_000, n, dtype=np.int32)), "loss_mask": pa.array(mask),
                       "logprobs": pa.array(np.where(mask == 1, -rng.exponential(1.0, n), 0.0).astype(np.float32))}
        self.id, self.episode_ids = f"e{env}-{number}", episode_ids

    @staticmethod
    def nbytes(turn: int) -> int:
        """Bytes of turn ``turn``'s row counted in MB/s: its tokens (int32), loss_mask
        (uint8) and logprobs (float32), 9 bytes a token (Table.nbytes costs more than a row)."""
        return (PROMPT_TOKENS + (turn + 1) * TURN_TOKENS) * 9

    def row(self, turn: int) -> pa.Table:
        """Turn ``turn``'s row: list columns over the episode's buffers (no copy)."""
        n = PROMPT_TOKENS + (turn + 1) * TURN_TOKENS
        offsets = pa.array([0, n], pa.int32())
        lists = {k: pa.ListArray.from_arrays(offsets, v.slice(0, n), type=TRAJECTORY_V1.field(k).type)
                 for k, v in self.values.items()}
        last = turn + 1 == self.turns
        columns = {"traj_id": pa.array([f"{self.id}-{turn}"]), "prompt_id": pa.array([self.id]),
                   "task": pa.array(["agent"]), **lists, "policy_version": pa.array([0], pa.int64()),
                   "reward": pa.array([1.0 if last else 0.0], pa.float32()),
                   "finish_reason": pa.array(["stop" if last else "length"])}
        if self.episode_ids:
            columns["episode_id"] = pa.array([self.id])
        return pa.table(columns)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


async def phase(address: str, srv: server.ServerProcess, envs: int, seconds: float, scale: float, path: str,
                linger_s: float, seed: int, checks: bool, profile: bool = False) -> dict:
    """``envs`` environments for ``seconds`` at time scale ``scale``; figures over the
    window after a warm-up of a tenth of the phase."""
    client = AsyncClient(address)
    batcher = client.batcher(TABLE, linger_s=linger_s, max_rows=1024) if path == "batcher" else None
    insert = batcher.insert if batcher else (lambda rows: client.insert(TABLE, rows))
    stop = asyncio.Event()
    done: list[tuple[float, float, int]] = []  # (finished at, latency s, Arrow bytes) per turn
    errors: list[str] = []
    steps: list[float] = []
    in_flight = 0

    async def environment(i: int) -> None:
        nonlocal in_flight
        env_rng = np.random.default_rng((seed, i))
        number = 0
        while not stop.is_set():
            episode = Episode(env_rng, i, number, checks)
            number += 1
            for turn, latency in enumerate(step_latencies(env_rng, episode.turns).tolist()):
                steps.append(latency)
                await asyncio.sleep(latency * scale)
                if stop.is_set():
                    return
                row = episode.row(turn)
                nbytes = Episode.nbytes(turn)
                t0 = time.perf_counter()
                in_flight += 1
                try:
                    await insert(row)
                    done.append((time.perf_counter(), time.perf_counter() - t0, nbytes))
                except Exception as e:  # counted, not raised: the figure is the error count
                    details = e.details() if isinstance(e, grpc.aio.AioRpcError) else e
                    errors.append(f"{type(e).__name__}: {details}")
                finally:
                    in_flight -= 1

    await client.create_table(TABLE, sampler="uniform", max_size=50_000_000, if_not_exists=True,
                              **({"ingest_checks": ["extends"]} if checks else {}))
    start = time.perf_counter()
    tasks = [asyncio.create_task(environment(i)) for i in range(envs)]
    warm = start + seconds / 10
    await asyncio.sleep(max(0.0, warm - time.perf_counter()))
    cpu0 = (cpu_seconds(srv.pid), own_cpu_seconds(), time.perf_counter())
    calls0 = batcher.calls if batcher else 0
    spies = [start_profile(pid, seconds * 0.8) for pid in (srv.pid, os.getpid())] if profile else [None, None]
    rss_peak, load = srv.rss_bytes(), []
    while time.perf_counter() < start + seconds:
        await asyncio.sleep(1.0)
        rss_peak = max(rss_peak, srv.rss_bytes())
        load.append(os.getloadavg()[0])
    cpu1 = (cpu_seconds(srv.pid), own_cpu_seconds(), time.perf_counter())
    calls1 = batcher.calls if batcher else 0
    rss_end = srv.rss_bytes()
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    stored = (await client.describe(TABLE)).num_items
    await client.close()

    window = cpu1[2] - cpu0[2]
    inside = [(lat, b) for t, lat, b in done if cpu0[2] <= t <= cpu1[2]]
    lat_ms = np.array([lat for lat, _ in inside] or [0.0]) * 1e3
    turns = len(inside)
    mean_step = float(np.mean(steps)) if steps else float("nan")
    return {
        "envs": envs, "seconds": seconds, "time_scale": scale, "path": path, "linger_ms": linger_s * 1e3,
        "extends_check": checks, "server_profile": finish_profile(spies[0]),
        "client_profile": finish_profile(spies[1]),
        "window_s": window,
        "mean_step_s": mean_step, "offered_turns_per_s": envs / (mean_step * scale),
        "turns": turns, "turns_per_s": turns / window, "rows_per_s": turns / window,
        "bytes_per_s": sum(b for _, b in inside) / window, "bytes_per_turn": sum(b for _, b in inside) / max(turns, 1),
        "insert_ms": {"p50": float(np.percentile(lat_ms, 50)), "p99": float(np.percentile(lat_ms, 99)),
                      "max": float(lat_ms.max())},
        "errors": len(errors), "error_samples": sorted(set(errors))[:5],
        "stored_items": stored, "inserts_ok_total": len(done),
        "server_rss_bytes": {"peak": rss_peak, "end": rss_end},
        "server_cpu_cores": (cpu1[0] - cpu0[0]) / window, "client_cpu_cores": (cpu1[1] - cpu0[1]) / window,
        "server_cpu_ms_per_turn": 1e3 * (cpu1[0] - cpu0[0]) / max(turns, 1),
        "client_cpu_ms_per_turn": 1e3 * (cpu1[1] - cpu0[1]) / max(turns, 1),
        "load_avg": float(np.mean(load)) if load else float("nan"), "rpcs_in_window": calls1 - calls0 if batcher else turns,
    }


IDLE = ("select (selectors.py", "_worker (concurrent/futures/thread.py:81)", "wait (threading.py", "Thread.run (")


def start_profile(pid: int, seconds: float):
    """py-spy sampling the server for ``seconds`` (None when py-spy is missing)."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        return None
    out = tempfile.NamedTemporaryFile(prefix="agentic-spy-", suffix=".txt", delete=False)
    proc = subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-f", "raw", "-o",
                             out.name, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, out.name


def finish_profile(spy) -> dict | None:
    """The server's busy samples: the share under each of the top functions (own time,
    idle waits left out), or None."""
    if spy is None:
        return None
    proc, path = spy
    try:
        proc.wait(timeout=120)
        own: Counter = Counter()
        with open(path) as f:
            for line in f:
                stack, n = line.rsplit(" ", 1)
                leaf = stack.split(";")[-1]
                if not any(idle in leaf for idle in IDLE):
                    own[leaf] += int(n)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    finally:
        os.unlink(path)
    total = sum(own.values())
    return {"busy_samples": total, "top_own": [[f, n / total] for f, n in own.most_common(8)]} if total else None


def bound(p: dict, cpus: int) -> str:
    """What limited a phase, from its own figures: the environments when the offered
    load was met; else the machine's CPU when its load average (other work included)
    reached its cores; else the busier of server and client."""
    if p["turns_per_s"] >= 0.9 * p["offered_turns_per_s"] and p["errors"] == 0:
        return "the environments (offered load met)"
    server_cpu, client_cpu = p["server_cpu_cores"], p["client_cpu_cores"]
    if p["load_avg"] >= 0.9 * cpus:
        return (f"CPU: load {p['load_avg']:.1f} on {cpus} cores (server {server_cpu:.2f}, client "
                f"{client_cpu:.2f} of it)")
    side, cores = ("server", server_cpu) if server_cpu >= client_cpu else ("client", client_cpu)
    return f"the {side} process ({cores:.2f} cores)"


def project(real: dict, saturated: dict, envs: int = PROJECTED_ENVS) -> dict:
    """100,000 environments on N shards, from this run's phases. Demand: what the
    environments ask when the store keeps up (envs / mean step latency, as offered in
    the real-time phase) x the bytes per turn measured. Shards, two ways: at 70% of the
    turns/s one server took in the saturation phase (what was shown; when the server
    was not what bounded that phase, its capacity is higher and this is an upper bound),
    and from the server's CPU per turn with one core per shard at 70% (the floor).
    Producer cores: demand x the client's CPU per turn."""
    demand = envs / real["mean_step_s"]
    shown = saturated["turns_per_s"]
    shards = max(1, math.ceil(demand / (shown * HEADROOM)))
    server_cores = demand * saturated["server_cpu_ms_per_turn"] / 1e3
    producer_cores = demand * saturated["client_cpu_ms_per_turn"] / 1e3
    return {
        "envs": envs, "basis": "projection from the measured phases, not a measurement",
        "demand_turns_per_s": demand, "demand_bytes_per_s": demand * real["bytes_per_turn"],
        "server_took_turns_per_s": shown, "server_was_the_bound": saturated["bound"].startswith("the server"),
        "headroom": HEADROOM, "shards": shards,
        "shards_floor_one_core_each": max(1, math.ceil(server_cores / HEADROOM)),
        "per_shard_turns_per_s": demand / shards, "per_shard_bytes_per_s": demand * real["bytes_per_turn"] / shards,
        "server_cores_total": server_cores, "producer_cores_total": producer_cores,
        "producer_processes": max(1, math.ceil(producer_cores / HEADROOM)),
        "rss_per_shard_bytes_measured": saturated["server_rss_bytes"]["peak"],
    }


def run(quick: bool, path: str = "batcher", checks: bool = False, linger_ms: float = 50.0) -> dict:
    envs, seconds = (1_000, (30.0, 20.0, 15.0)) if quick else (10_000, (90.0, 45.0, 30.0))
    cpus = os.cpu_count() or 1
    with server.start_expstore() as srv:
        rss_idle = srv.rss_bytes()
        real = asyncio.run(phase(srv.address, srv, envs, seconds[0], 1.0, path, linger_ms / 1e3, 1, checks))
        saturated = asyncio.run(phase(srv.address, srv, envs, seconds[1], SATURATE, path, linger_ms / 1e3, 2,
                                      checks, profile=True))
        small = asyncio.run(phase(srv.address, srv, envs, seconds[2], SATURATE, path, 0.005, 3, checks))
    for p in (real, saturated, small):
        p["bound"] = bound(p, cpus)
    return {"quick": quick, "cpus": cpus, "server_rss_idle_bytes": rss_idle,
            "shape": {"prompt_tokens": PROMPT_TOKENS, "turn_tokens": TURN_TOKENS, "turns": list(TURNS),
                      "step_latency": f"log-normal median {MEDIAN_S} s sigma {SIGMA}, clipped to {list(CLIP_S)} s"},
            "real_time": real, "saturation": saturated, "saturation_5ms_linger": small,
            "projection": project(real, saturated)}


def render(s: dict) -> str:
    mode = "quick" if s.get("quick") else "full"
    rows = []
    scale = f"x{1 / s['saturation']['time_scale']:.0f} time"
    for label, p in (("real time", s["real_time"]), (f"saturation ({scale})", s["saturation"]),
                     (f"saturation ({scale}), 5 ms linger", s["saturation_5ms_linger"])):
        rows.append([label, _f(p["envs"]), _f(p["offered_turns_per_s"]), _f(p["turns_per_s"]),
                     _f(p["turns_per_s"] * p["window_s"] / max(p["rpcs_in_window"], 1), 1),
                     _f(p["bytes_per_s"] / 1e6, 1), _f(p["insert_ms"]["p50"], 1), _f(p["insert_ms"]["p99"], 1),
                     _f(p["errors"]), f"{p['load_avg']:.1f}", _f(p["server_rss_bytes"]["peak"] / 2**20), f"{p['server_cpu_cores']:.2f}",
                     f"{p['client_cpu_cores']:.2f}", p["bound"]])
    pr = s["projection"]
    return "\n".join([
        f"9. Agentic scale ({mode}; benchmarks/agentic_scale.py): simulated environments, multi-turn inserts "
        f"({s['shape']['prompt_tokens']} + {s['shape']['turn_tokens']}/turn tokens, {s['shape']['turns'][0]}-"
        f"{s['shape']['turns'][1]} turns), steps {s['shape']['step_latency']}; one server, "
        f"{s['real_time']['path']} path ({s['real_time']['linger_ms']:.0f} ms linger)"
        f"{', extends check' if s['real_time']['extends_check'] else ''}, "
        f"{s['cpus']} CPUs",
        _table(["phase", "envs", "offered turns/s", "turns/s (rows/s)", "rows/RPC", "MB/s", "p50 ms", "p99 ms",
                "errors", "load",
                "server RSS MiB", "server cores", "client cores", "bound"], rows),
        f"   PROJECTION (computed from the rows above, not measured): {pr['envs']:,} envs ask "
        f"{_f(pr['demand_turns_per_s'])} turns/s ({_f(pr['demand_bytes_per_s'] / 1e6, 1)} MB/s). ShardedClient over "
        f"{pr['shards']} shards at {pr['headroom']:.0%} of the {_f(pr['server_took_turns_per_s'])} turns/s one server "
        f"took ({_f(pr['per_shard_turns_per_s'])} turns/s, {_f(pr['per_shard_bytes_per_s'] / 1e6, 1)} MB/s, "
        f"RSS ~{_f(pr['rss_per_shard_bytes_measured'] / 2**20)} MiB each"
        f"{'' if pr['server_was_the_bound'] else '; the server was not the bound, so fewer may do'}); "
        f"server CPU alone: {pr['server_cores_total']:.1f} cores, a floor of {pr['shards_floor_one_core_each']} "
        f"shard(s) of one core; producers: {pr['producer_cores_total']:.1f} cores, "
        f"{pr['producer_processes']} event-loop processes at {pr['headroom']:.0%}",
        *profile_lines("server", s["saturation"].get("server_profile")),
        *profile_lines("client", s["saturation"].get("client_profile"))])


def profile_lines(side: str, prof: dict | None) -> list[str]:
    if not prof:
        return []
    top = "; ".join(f"{share:.0%} {frame}" for frame, share in prof["top_own"][:5])
    return [f"   {side} busy samples in saturation (py-spy, own time): {top}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks.agentic_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1,000 environments, ~1 minute")
    p.add_argument("--path", choices=["batcher", "insert"], default="batcher",
                   help="InsertBatcher (default) or one AsyncClient.insert per turn")
    p.add_argument("--linger-ms", type=float, default=50.0, help="the batcher's linger (real time and saturation)")
    p.add_argument("--extends-check", action="store_true",
                   help="the table checks that each episode's rows extend each other (ingest_checks)")
    a = p.parse_args(argv)
    out = run(a.quick, a.path, a.extends_check, a.linger_ms)
    print(render(out), file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
